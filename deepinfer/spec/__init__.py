"""Speculative decoding: where drafts come from (drafter.py: the n-gram drafter, and the
model drafters' interface; dspark.py: DeepSeek-V4.1's DSpark run inside the step), how a
step's drafts are verified (verify.py, with the lossless accept/reject rule of
rejection.py), how many each request verifies (scheduling.py: the hardware-aware prefix
scheduler and confidence calibration), and the counters (stats.py). rejection.py and
scheduling.py know nothing of models, caches or the runner."""
