"""Verification of draft tokens against the target's logits, for a batch of sequences.

Sequence r fed its last sampled token and ``num_draft[r]`` = l_r drafts, so the target gave
l_r + 1 logits rows (rows ``o_r .. o_r + l_r`` of ``logits``): row j is the target's
distribution for the token after draft j (row 0: after the last sampled token). Row j's
distribution is taken after the sequence's own sampling transforms with the drafts before
it counted as output (penalties, min_tokens and seeds see them): the caller builds one
:class:`SamplingRow` per row that way.

All-greedy batches (the common case) accept drafts while they equal the row's argmax and
commit the argmax of the first row that differs, or of the last row (the bonus token):
exactly the tokens greedy decoding without drafts gives. Otherwise the rows' target
distributions go through lossless rejection sampling (spec/rejection.py).

What belongs here: turning ragged rows into the padded [R, K + 1] layout and back, and
choosing the greedy or sampled rule. What does not: the accept/reject math (rejection.py),
the processors and filters (runner/sampler.py), the drafts (the proposers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kernels import backend
from deepinfer.runner.sampler import Sampler, SampleTensors, SamplingRow, _plain_greedy
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
           draft_token_ids: list[list[int]], max_draft: int,
           draft_probs: list[torch.Tensor | None] | None = None,
           token_bitmask: torch.Tensor | None = None) -> VerifyTensors:
    """Verify R sequences' drafts (see the module docstring).

    logits: [N, V'] with N = sum(1 + l_r); rows: N SamplingRows; num_draft: R ints l_r;
    draft_token_ids: R lists of l_r ids; draft_probs: per sequence [l_r, V] float32, the
    distribution each draft was sampled from, or None for a deterministic draft (n-gram,
    greedy); None for all: every draft deterministic. ``max_draft``: the engine's longest
    draft (seeded rows draw that many uniforms whatever the batch's longest is, so their
    draws do not depend on the other rows). ``token_bitmask``: [N, ceil(V / 32)] int32, row i
    applied where ``rows[i].grammar`` (the grammar after the drafts before that row).

    With a grammar, the drafts were cut at the first one it refuses (the runner does, when
    they are proposed), a choice that depends on the drafts themselves; verification stays
    exact because a sampled draft's p_d is then taken as the drafter's distribution masked by
    the grammar and renormalised: the distribution of the drafts that can reach verification."""
    dev = logits.device
    r_count, k = len(num_draft), max(num_draft)
    offsets = [0]
    for n in num_draft:
        offsets.append(offsets[-1] + n + 1)
    # idx[r, j]: the logits row of sequence r's position j, clamped to its last row.
    idx = to_device([[offsets[r] + min(j, num_draft[r]) for j in range(k + 1)] for r in range(r_count)],
                    torch.long, dev)                                                        # [R, K+1]
    drafts = to_device([d + [0] * (k - len(d)) for d in draft_token_ids], torch.long, dev)   # [R, K] padded
    lengths = to_device(num_draft, torch.long, dev)                                         # [R]
    if all(_plain_greedy(row) for row in rows):
        tokens, sampled = backend.greedy_sample(logits, sampler.vocab_size)                 # [N], [N]
        best = tokens[idx]                                                                  # [R, K+1]
        _, num_tokens = rejection.greedy_verify(best, drafts, lengths)
        return VerifyTensors(SampleTensors(tokens, sampled, [], []), num_tokens)
    p_t = sampler.target_probs(logits, rows, token_bitmask)[idx]                            # [R, K+1, V]
    p_d = None
    if draft_probs is not None and any(p is not None for p in draft_probs):
        p_d = torch.zeros(r_count, k, p_t.shape[-1], dtype=torch.float32, device=dev)       # [R, K, V]
        for r, probs in enumerate(draft_probs):
            n = num_draft[r]
            if probs is None:       # a deterministic draft: one-hot
                p_d[r, torch.arange(n, device=dev), drafts[r, :n]] = 1.0
            else:
                p_d[r, :n] = probs[:n]
        if token_bitmask is not None:
            _mask_draft_probs(p_d, token_bitmask, rows, offsets, num_draft)
    uniforms, noise = _draws(sampler, [rows[offsets[r]] for r in range(r_count)], k, max_draft,
                             p_t.shape[-1], dev)
    committed, num_tokens = rejection.rejection_sample(p_t, p_d, drafts, lengths, uniforms, noise)  # [R, K+1], [R]
    # Back to one token per logits row: row o_r + j <- committed[r, j] for j <= l_r.
    src = [r * (k + 1) + j for r in range(r_count) for j in range(num_draft[r] + 1)]
    flat = committed.flatten()[to_device(src, torch.long, dev)].clamp_min(0)               # [N]
    return VerifyTensors(sampler.logprobs_of(logits, rows, flat), num_tokens)


def _draws(sampler: Sampler, firsts: list[SamplingRow], k: int, max_draft: int, vocab_size: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection sampler's random draws (uniforms [R, K], noise [R, V]): a seeded
    sequence's keyed by its seed, sample index and the output position of the step's first
    verified row (``firsts[r]``, whose output is the sequence's output so far), the others'
    from the sampler's generator."""
    seeded = [r for r, row in enumerate(firsts) if row.params.seed is not None]
    uniforms, noise = rejection.random_draws(len(firsts), k, vocab_size, sampler.generator)
    if seeded:
        su, sn = rejection.seeded_draws([firsts[r].params.seed for r in seeded],
                                        [firsts[r].stream_index for r in seeded],
                                        [len(firsts[r].output_token_ids) for r in seeded],
                                        max_draft, vocab_size, device)
        idx = to_device(seeded, torch.long, device)
        uniforms[idx], noise[idx] = su[:, :k], sn
    return uniforms, noise


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
