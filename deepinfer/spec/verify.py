"""Verification of draft tokens against the target's logits, for a batch of sequences.

Sequence r fed its last sampled token and ``num_draft[r]`` = l_r drafts, so the target gave
l_r + 1 logits rows (rows ``o_r .. o_r + l_r`` of ``logits``): row j is the target's
distribution for the token after draft j (row 0: after the last sampled token). Row j's
distribution is taken after the sequence's own sampling transforms with the drafts before
it counted as output (penalties, min_tokens and seeds see them): the caller builds one
:class:`SamplingRow` per row that way.

Greedy and seeded sequences take exact-match verification: every row is sampled as the
sampler samples it without drafts (the argmax, or the race against noise keyed by the
seed and the row's output position), drafts are accepted while they equal those tokens,
and the committed tokens are the sampler's own, up to the first row whose token differs
from its draft (or the last row: the bonus). Their output is the output without
speculation, token for token, whatever the drafts, the number verified, the batch or a
preemption did: deterministic sampling (a drafter that draws with the same keyed noise,
spec/draft_sampling.py, keeps acceptance high). Unseeded sampled sequences take lossless
rejection sampling (spec/rejection.py), which accepts more (min(p_d, p_t) mass instead
of the coupled draws' agreement) but whose realisation depends on how many drafts a step
verified.

With a grammar, the drafts were cut at the first one it refuses (the runner does, when
they are proposed), a choice that depends on the drafts themselves; rejection sampling
stays exact because a sampled draft's p_d is then taken as the drafter's distribution
masked by the grammar and renormalised: the distribution of the drafts that can reach
verification.

What belongs here: turning ragged rows into the padded [R, K + 1] layout and back, and
choosing the rule per sequence. What does not: the accept/reject math (rejection.py),
the processors and filters (runner/sampler.py), the drafts (the proposers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.runner.sampler import Sampler, SampleTensors, SamplingRow
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec import rejection
from deepinfer.transfer import to_device


@dataclass
class VerifyTensors:
    """A verification's result on the device. ``rows`` has one entry per logits row: row
    o_r + j holds committed token j of sequence r (and its logprobs) for j < num_tokens[r];
    later rows of r hold tokens that are not committed."""

    rows: SampleTensors
    num_tokens: torch.Tensor      # [R] int64: accepted drafts + 1

    def to_host(self) -> "VerifyTensors":
        return VerifyTensors(self.rows.to_host(), self.num_tokens.to("cpu", non_blocking=True))


def verify(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], num_draft: list[int],
           draft_token_ids: list[list[int]], draft_probs: list[torch.Tensor | None] | None = None,
           token_bitmask: torch.Tensor | None = None) -> VerifyTensors:
    """Verify R sequences' drafts (see the module docstring).

    logits: [N, V'] with N = sum(1 + l_r); rows: N SamplingRows; num_draft: R ints l_r;
    draft_token_ids: R lists of l_r ids; draft_probs: per sequence [l_r, V] float32, the
    distribution each draft was sampled from, or None for a deterministic draft (n-gram,
    greedy); None for all: every draft deterministic. ``token_bitmask``: [N, ceil(V / 32)]
    int32, row i applied where ``rows[i].grammar`` (the grammar after the drafts before it)."""
    dev = logits.device
    r_count = len(num_draft)
    offsets = [0]
    for n in num_draft:
        offsets.append(offsets[-1] + n + 1)
    exact = [r for r in range(r_count) if _exact_match(rows[offsets[r]].params)]
    other = [r for r in range(r_count) if not _exact_match(rows[offsets[r]].params)]
    if len(exact) == r_count:
        # The sampler's own tokens and logprobs for every row (one greedy pass when plain).
        sampled = sampler.sample(logits, rows, token_bitmask)
        _, num_tokens = _accept_matching(sampled.token_ids, num_draft, draft_token_ids, dev)
        return VerifyTensors(sampled, num_tokens)
    flat = torch.zeros(logits.shape[0], dtype=torch.long, device=dev)                      # [N] row tokens
    num_tokens = torch.zeros(r_count, dtype=torch.long, device=dev)                        # [R]
    if exact:
        sel = _rows_of(exact, offsets)
        sampled = sampler.sample(logits[_long(sel, dev)], [rows[i] for i in sel],
                                 None if token_bitmask is None else token_bitmask[_long(sel, dev)])
        _, n = _accept_matching(sampled.token_ids, [num_draft[r] for r in exact],
                                [draft_token_ids[r] for r in exact], dev)
        flat[_long(sel, dev)] = sampled.token_ids
        num_tokens[_long(exact, dev)] = n
    sel = _rows_of(other, offsets)
    tokens, n = _rejection(sampler, logits[_long(sel, dev)], [rows[i] for i in sel],
                           [num_draft[r] for r in other], [draft_token_ids[r] for r in other],
                           None if draft_probs is None else [draft_probs[r] for r in other],
                           None if token_bitmask is None else token_bitmask[_long(sel, dev)])
    flat[_long(sel, dev)] = tokens
    num_tokens[_long(other, dev)] = n
    return VerifyTensors(sampler.logprobs_of(logits, rows, flat), num_tokens)


def _exact_match(params: SamplingParams) -> bool:
    """Greedy and seeded requests are verified by exact match (see the module docstring)."""
    return params.greedy or params.seed is not None


def _rows_of(seqs: list[int], offsets: list[int]) -> list[int]:
    """The logits rows of sequences ``seqs`` (sequence r: rows offsets[r] .. offsets[r+1]-1)."""
    return [i for r in seqs for i in range(offsets[r], offsets[r + 1])]


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.long, device)


def _layout(num_draft: list[int], device: torch.device) -> tuple[list[int], torch.Tensor]:
    """(row offsets [R+1], idx [R, K+1]: the row of sequence r's position j, clamped to its
    last row) of sequences of 1 + l_r rows each."""
    k = max(num_draft)
    offsets = [0]
    for n in num_draft:
        offsets.append(offsets[-1] + n + 1)
    idx = _long([[offsets[r] + min(j, n) for j in range(k + 1)] for r, n in enumerate(num_draft)], device)
    return offsets, idx


def _padded_drafts(drafts: list[list[int]], k: int, device: torch.device) -> torch.Tensor:
    return _long([d + [0] * (k - len(d)) for d in drafts], device)                     # [R, K]


def _accept_matching(tokens: torch.Tensor, num_draft: list[int], drafts: list[list[int]],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact match: ``tokens`` [N] the sampler's token of every row -> (committed [R, K+1],
    num_tokens [R]): drafts accepted while they equal their row's token, then that row's."""
    _, idx = _layout(num_draft, device)
    return rejection.greedy_verify(tokens[idx], _padded_drafts(drafts, max(num_draft), device),
                                   _long(num_draft, device))


def _rejection(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], num_draft: list[int],
               draft_token_ids: list[list[int]], draft_probs: list[torch.Tensor | None] | None,
               token_bitmask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling of S sequences (their rows only) -> (a token per row [N],
    num_tokens [S])."""
    dev = logits.device
    s_count, k = len(num_draft), max(num_draft)
    offsets, idx = _layout(num_draft, dev)
    drafts = _padded_drafts(draft_token_ids, k, dev)                                      # [S, K]
    p_t = sampler.target_probs(logits, rows, token_bitmask)[idx]                           # [S, K+1, V]
    p_d = None
    if draft_probs is not None and any(p is not None for p in draft_probs):
        p_d = torch.zeros(s_count, k, p_t.shape[-1], dtype=torch.float32, device=dev)     # [S, K, V]
        for r, probs in enumerate(draft_probs):
            n = num_draft[r]
            if probs is None:       # a deterministic draft: one-hot
                p_d[r, torch.arange(n, device=dev), drafts[r, :n]] = 1.0
            else:
                p_d[r, :n] = probs[:n]
        if token_bitmask is not None:
            _mask_draft_probs(p_d, token_bitmask, rows, offsets, num_draft)
    uniforms, noise = rejection.random_draws(s_count, k, p_t.shape[-1], sampler.generator)
    committed, num_tokens = rejection.rejection_sample(p_t, p_d, drafts, _long(num_draft, dev), uniforms, noise)
    # Back to one token per row: row offsets[r] + j <- committed[r, j] for j <= l_r.
    src = [r * (k + 1) + j for r in range(s_count) for j in range(num_draft[r] + 1)]
    return committed.flatten()[_long(src, dev)].clamp_min(0), num_tokens


def _mask_draft_probs(p_d: torch.Tensor, token_bitmask: torch.Tensor, rows: list[SamplingRow],
                      offsets: list[int], num_draft: list[int]) -> None:
    """p_d [R, K, V] of grammar sequences, in place: draft j's distribution restricted to the
    tokens its row's grammar allows (verification row j: the state draft j was drawn in) and
    renormalised."""
    from deepinfer.structured.bitmask import apply_token_bitmask

    for r, n in enumerate(num_draft):
        if n == 0 or not rows[offsets[r]].grammar:
            continue
        sel = torch.arange(offsets[r], offsets[r] + n, device=p_d.device)
        logp = p_d[r, :n].log().contiguous()                                             # [n, V]
        apply_token_bitmask(logp, token_bitmask.index_select(0, sel), list(range(n)))
        p_d[r, :n] = torch.softmax(logp, dim=-1)
