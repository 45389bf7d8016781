"""spec/verify.py: the ragged layout around the rejection sampler, greedy verification equal
to the argmax chain, and the grammar restriction of sampled drafts' distributions."""

from __future__ import annotations

import torch

from deepinfer.runner.sampler import Sampler, SamplingRow
from deepinfer.sampling_params import SamplingParams
from deepinfer.spec.verify import _mask_draft_probs, verify
from deepinfer.structured.bitmask import allocate_token_bitmask

V = 40


def rows_for(params: SamplingParams, num_draft: list[int], drafts: list[list[int]]) -> list[SamplingRow]:
    return [SamplingRow(params, [1, 2], list(d[:j])) for n, d in zip(num_draft, drafts) for j in range(n + 1)]


def test_greedy_verification_commits_the_argmax_chain():
    g = torch.Generator().manual_seed(0)
    num_draft, drafts = [3, 0, 2], [[5, 6, 7], [], [8, 9]]
    logits = torch.randn(sum(n + 1 for n in num_draft), V, generator=g)
    argmax = logits.argmax(-1).tolist()
    drafts[0][:2] = argmax[0:2]                 # sequence 0: two accepted, the third rejected
    drafts[2] = argmax[5:7]                     # sequence 2: all accepted, then the bonus
    sampler = Sampler(V, {0})
    out = verify(sampler, logits, rows_for(SamplingParams(temperature=0.0), num_draft, drafts), num_draft, drafts)
    assert out.num_tokens.tolist() == [3, 1, 3]
    tokens = out.rows.token_ids.tolist()
    assert tokens[0:3] == argmax[0:3] and tokens[4] == argmax[4] and tokens[5:8] == argmax[5:8]


def test_grammar_restricts_sampled_draft_distributions():
    g = torch.Generator().manual_seed(1)
    p_d = torch.softmax(torch.randn(1, 2, V, generator=g), -1)                    # [R=1, K=2, V]
    bitmask = allocate_token_bitmask(3, V)                                          # rows: 2 drafts + 1
    allowed = [{1, 5, 33}, {2, 3, 4, 39}]
    for j, keep in enumerate(allowed):
        for t in range(V):
            if t not in keep:
                bitmask[j, t // 32] &= ~(1 << (t % 32))
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], [], grammar=True) for _ in range(3)]
    want = p_d.clone()
    _mask_draft_probs(p_d, bitmask, rows, [0, 3], [2])
    for j, keep in enumerate(allowed):
        mask = torch.zeros(V, dtype=torch.bool)
        mask[list(keep)] = True
        expected = torch.where(mask, want[0, j], 0.0)
        torch.testing.assert_close(p_d[0, j], expected / expected.sum())
