"""The Triton routing kernels against reference.biased_topk / hash_route / softmax_topk /
grouped_topk_sigmoid on random logits.

Selection order differs (the kernels return experts best first, torch.topk(sorted=False)
in any order), so top-k results are compared after sorting each row by expert id.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.moe_routing import (
    grouped_topk_sigmoid,
    hash_route,
    softmax_topk,
    topk_route,
)


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def random_logits(t: int, e: int, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    """Logits with wide tails (softplus far into both of its regimes) and a few extremes."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=gen) * 4
    logits.view(-1)[::7] = -30.0
    logits.view(-1)[3::11] = 25.0
    return logits.to(dtype).to(device)


@pytest.mark.parametrize("t,e,k", [(1, 6, 2), (5, 64, 6), (33, 64, 6)])
@pytest.mark.parametrize("scoring_func", ["sqrtsoftplus", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biased_topk_matches_reference(t, e, k, scoring_func, dtype, device):
    logits = random_logits(t, e, dtype, device, seed=t * 100 + e)
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(1)) * 0.5).to(device)
    weights, ids = topk_route(logits, k, scoring_func, 2.5, renormalize=True, bias=bias)
    ref_w, ref_ids = reference.biased_topk(logits, bias, k, scoring_func, 2.5)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    weights, ids = by_expert(weights, ids)
    ref_w, ref_ids = by_expert(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights.sum(-1), torch.full((t,), 2.5, device=device))


def test_biased_topk_selects_by_bias_but_weights_by_score(device):
    """A large bias on expert 3 makes it win; its weight is still its unbiased score."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], device=device)
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0, 0.0], device=device)
    weights, ids = topk_route(logits, 2, "sigmoid", 1.0, renormalize=True, bias=bias)
    assert ids.tolist() == [[3, 0]]
    s = torch.sigmoid(torch.tensor([-1.0, 2.0]))
    torch.testing.assert_close(weights.cpu(), (s / s.sum())[None])


@pytest.mark.parametrize("t,scoring_func,table_dtype", [(1, "sqrtsoftplus", torch.int64),
                                                        (33, "sqrtsoftplus", torch.int64),
                                                        (5, "sigmoid", torch.int32)])
def test_hash_route_matches_reference(t, scoring_func, table_dtype, device):
    gen = torch.Generator().manual_seed(t)
    e, k, vocab = 12, 3, 50
    logits = random_logits(t, e, torch.float32, device, seed=t)
    tid2eid = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(vocab)]).to(table_dtype)
    input_ids = torch.randint(0, vocab, (t,), generator=gen)
    weights, ids = hash_route(logits, tid2eid.to(device), input_ids.to(device), scoring_func, 1.5)
    ref_w, ref_ids = reference.hash_route(logits, tid2eid.to(device), input_ids.to(device), scoring_func, 1.5)
    assert torch.equal(ids, ref_ids)                      # the table's order is kept
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (5, 60, 8), (33, 60, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_matches_reference(t, e, k, renormalize, device):
    logits = random_logits(t, e, torch.bfloat16, device, seed=e + k)
    weights, ids = softmax_topk(logits, k, renormalize)
    ref_w, ref_ids = reference.softmax_topk(logits, k, renormalize)
    weights, ids = by_expert(weights, ids)
    ref_w, ref_ids = by_expert(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("t,e,groups,topk_groups,k", [(1, 16, 4, 2, 3), (5, 24, 8, 3, 4), (33, 12, 3, 1, 2),
                                                      (33, 16, 4, 2, 3)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_sigmoid_matches_reference(t, e, groups, topk_groups, k, renormalize, device):
    logits = random_logits(t, e, torch.float32, device, seed=e * t)
    bias = (torch.randn(e, generator=torch.Generator().manual_seed(e)) * 0.3).to(device)
    weights, ids = grouped_topk_sigmoid(logits, bias, groups, topk_groups, k, renormalize, 2.5)
    ref_w, ref_ids = reference.grouped_topk_sigmoid(logits, bias, groups, topk_groups, k, renormalize, 2.5)
    weights, ids = by_expert(weights, ids)
    ref_w, ref_ids = by_expert(ref_w, ref_ids)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=1e-6)
    groups_used = torch.zeros(t, groups, device=device).scatter_(1, ids // (e // groups), 1.0).sum(-1)
    assert (groups_used <= topk_groups).all()


def test_grouped_topk_sigmoid_limits_groups(device):
    """Group 1 holds the single best expert but group 0 the best pair: with one group kept,
    both picks come from group 0."""
    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0, 3.0, -5.0, -5.0, -5.0]], device=device)
    _, ids = grouped_topk_sigmoid(logits, torch.zeros(8, device=device), 2, 1, 2, True, 1.0)
    assert sorted(ids[0].tolist()) == [0, 1]


def test_routing_rejects_bad_arguments(device):
    logits = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match="top_k=9"):
        topk_route(logits, 9, "sigmoid", 1.0, True)
    with pytest.raises(ValueError, match="scoring_func"):
        topk_route(logits, 2, "relu", 1.0, True)
    with pytest.raises(ValueError, match="num_groups=3"):
        grouped_topk_sigmoid(logits, torch.zeros(8, device=device), 3, 1, 2, True, 1.0)
    with pytest.raises(ValueError, match="input_ids"):
        hash_route(logits, torch.zeros(10, 2, dtype=torch.long, device=device),
                   torch.zeros(4, dtype=torch.long, device=device), "sigmoid", 1.0)


def test_routing_empty_batch(device):
    weights, ids = topk_route(torch.empty(0, 8, device=device), 2, "softmax", 1.0, True)
    assert weights.shape == (0, 2) and ids.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_routing_gpu_sizes(t):
    """DeepSeek-V4 (E=256, K=6), V3 (8 groups, 4 kept, K=8) and Qwen3-MoE (E=128, K=8) widths."""
    logits = random_logits(t, 256, torch.float32, "cuda", seed=t)
    bias = torch.randn(256, device="cuda") * 0.1
    for got, ref in (
        (topk_route(logits, 6, "sqrtsoftplus", 1.5, True, bias),
         reference.biased_topk(logits, bias, 6, "sqrtsoftplus", 1.5)),
        (grouped_topk_sigmoid(logits, bias, 8, 4, 8, True, 2.5),
         reference.grouped_topk_sigmoid(logits, bias, 8, 4, 8, True, 2.5)),
        (softmax_topk(logits[:, :128], 8, True), reference.softmax_topk(logits[:, :128], 8, True)),
    ):
        w, ids = by_expert(*got)
        ref_w, ref_ids = by_expert(*ref)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=1e-5, atol=1e-6)
