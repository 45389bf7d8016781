"""Speculative decoding, engine-independent: the lossless accept/reject rule
(rejection.py) and the choice of how many draft tokens each request verifies
(scheduling.py). Nothing here knows about models, KV caches or the runner."""
