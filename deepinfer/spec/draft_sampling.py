"""How a model drafter samples its drafts, per request: shared by DSpark (spec/dspark.py) and
the chained MTP drafter (spec/mtp.py).

What belongs here: turning the committed requests' sampling parameters into a
:class:`~deepinfer.models.dspark.DraftSampling` (temperature, the engine's min-p / top-k /
top-p filters, and the exponential-race noise of seeded requests). What does not: picking a
token from logits (:func:`~deepinfer.models.dspark.pick_draft`) or verification.

A seeded sampled request's draft for output index i (the token at position
``prompt_len + i``) races against the very noise the sampler draws for that output index
(``stream_seed(seed, sample index, i)``, runner/sampler.py). Verification of seeded
requests is exact match against the sampler's own tokens (spec/verify.py), so the drafts
never change the output; drawing them with the same noise makes a draft agree with the
target's token whenever the two distributions put the race's winner in the same place (the
Gumbel-max coupling), which keeps acceptance close to rejection sampling's. Unseeded
sampled rows draw from the runner's generator.
"""

from __future__ import annotations

import torch

from deepinfer.models.dspark import DraftSampling
from deepinfer.runner.sampler import stream_seed
from deepinfer.sampling_params import SamplingParams
from deepinfer.transfer import to_device

def draft_sampling(params: list[SamplingParams], stream_indices: list[int], prompt_lens: list[int],
                   last_positions: torch.Tensor, generator: torch.Generator, num_slots: int,
                   vocab_size: int) -> DraftSampling | None:
    """The sampling of B requests' drafts (None when every one is greedy).

    last_positions: [B] int64 on the device (each request's ``s``; slot k drafts the token at
    position ``s + 2 + k``); num_slots: draft slots a proposal draws (G). ``noise`` [B, G, V]
    is drawn here, outside the proposal (a CUDA graph of the proposal reads it from a static
    buffer): from ``generator``, and for seeded sampled rows from the sampler's keyed
    generators (a host sync on ``last_positions``, for seeded sampled requests only).
    """
    if all(p.greedy for p in params):
        return None
    dev = last_positions.device
    v = vocab_size
    noise = torch.empty(len(params), num_slots, v, device=dev).exponential_(generator=generator)
    seeded = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy]
    if seeded:
        starts = last_positions.tolist()
        for i in seeded:
            first = starts[i] + 2 - prompt_lens[i]               # output index of slot 0's token
            for k in range(num_slots):
                gen = torch.Generator(device=dev)
                gen.manual_seed(stream_seed(params[i].seed, stream_indices[i], first + k))
                noise[i, k] = torch.empty(v, dtype=torch.float32, device=dev).exponential_(generator=gen)
    filters = any(p.min_p > 0 or 0 < p.top_k < v or p.top_p < 1.0 for p in params)
    return DraftSampling(
        greedy=to_device([p.greedy for p in params], torch.bool, dev),
        temperature=to_device([1.0 if p.greedy else p.temperature for p in params], torch.float32, dev),
        min_p=to_device([p.min_p for p in params], torch.float32, dev) if filters else None,
        top_k=to_device([p.top_k if 0 < p.top_k < v else v for p in params], torch.long, dev) if filters else None,
        top_p=to_device([p.top_p for p in params], torch.float32, dev) if filters else None,
        noise=noise, generator=generator)
