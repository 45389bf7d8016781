"""The Triton sampling filters (min-p, top-k, top-p without a sort) against
reference.sampling_filters_, and the sampler's tokens on both backends."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.sampling import sampling_filters_
from deepinfer.runner.sampler import Sampler, SamplingRow
from deepinfer.sampling_params import SamplingParams

NEG = float("-inf")


def shifted_logits(r: int, v: int, seed: int, scale: float = 2.5, device="cpu") -> torch.Tensor:
    """[R, V] float32 as the sampler hands them over: row max 0 (then divided by a temperature)."""
    x = torch.randn(r, v, generator=torch.Generator().manual_seed(seed)) * scale
    return (x - x.amax(-1, keepdim=True)).to(device)


def params(min_p, top_k, top_p, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.tensor(min_p, dtype=torch.float32, device=device),
            torch.tensor(top_k, dtype=torch.int64, device=device),
            torch.tensor(top_p, dtype=torch.float32, device=device))


def on_boundary(row: torch.Tensor, i: int, min_p: float, k: int, p: float, kept_by_torch: torch.Tensor,
                margin: float = 1e-5) -> bool:
    """Whether token i, kept by one path only, sits where the two may legitimately disagree
    (float64 check): its probability ratio within ``margin`` of min_p, its cumulative mass
    within ``margin`` of 1 - p, or (kept by the kernel only) a member of a top-p tie group
    that the torch path split: the kernel keeps such a group whole."""
    x = row.double()
    probs = x.softmax(-1)
    if min_p > 0 and abs(float(probs[i] / probs.max()) - min_p) < margin:
        return True
    y = x.masked_fill(probs < probs.max() * min_p, NEG)
    if k < y.numel():
        y = y.masked_fill(y < y.topk(k).values[-1], NEG)
    q = y.softmax(-1)
    if p < 1 and (abs(float(q[y <= y[i]].sum()) - (1 - p)) < margin
                  or abs(float(q[y < y[i]].sum()) - (1 - p)) < margin):
        return True
    split_tie = not kept_by_torch[i] and bool(((row == row[i]) & kept_by_torch).any())
    return p < 1 and split_tie


def assert_same_filtering(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, min_p: torch.Tensor,
                          top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Kept values untouched; dropped ones -inf; the kept sets equal except on_boundary tokens."""
    kept, rkept = out > NEG, ref > NEG
    assert torch.equal(out[kept], x[kept])
    assert (out[~kept] == NEG).all()
    for r, i in (kept ^ rkept).nonzero().tolist():
        assert on_boundary(x[r].cpu(), i, float(min_p[r]), int(top_k[r]), float(top_p[r]), rkept[r].cpu()), \
            f"row {r} token {i}: kernel keeps={bool(kept[r, i])}, torch keeps={bool(rkept[r, i])}"


def run_both(x, min_p, top_k, top_p, cap=4096):
    out, ref = x.clone(), x.clone()
    sampling_filters_(out, min_p, top_k, top_p, cap=cap)
    reference.sampling_filters_(ref, min_p, top_k, top_p)
    return out, ref


@pytest.mark.parametrize("cap", [4096, 16])
def test_filters_match_reference(cap, device, poison_empty):
    """Mixed rows: each filter alone, all three, and none. cap=16 forces the narrowing passes
    and the interval gathers (top-k's k above the cap, top-p's nucleus above it)."""
    v = 1000
    x = shifted_logits(5, v, seed=cap) / torch.tensor([[1.0], [0.7], [1.3], [1.0], [0.5]]).to(device)
    min_p, top_k, top_p = params([0.0, 0.05, 0.0, 0.02, 0.0], [v, v, 40, 300, v],
                                 [0.9, 1.0, 1.0, 0.8, 1.0], device)
    out, ref = run_both(x, min_p, top_k, top_p, cap)
    assert torch.equal(out[4], x[4])                                     # no filter: untouched
    assert_same_filtering(out, ref, x, min_p, top_k, top_p)
    kept = (out > NEG).sum(-1).tolist()
    assert kept[2] == 40 and 1 < kept[0] < v and 1 < kept[1] < v


@pytest.mark.parametrize("rows,seed", [(1, 1), (3, 2), (4, 3)])
def test_filters_random_parameters(rows, seed, device):
    gen = torch.Generator().manual_seed(seed)
    v = 1000
    x = shifted_logits(rows, v, seed=seed + 10, device=device)
    min_p = torch.where(torch.rand(rows, generator=gen) < 0.5, torch.rand(rows, generator=gen) * 0.1, 0.0)
    top_k = torch.where(torch.rand(rows, generator=gen) < 0.6, torch.randint(1, v, (rows,), generator=gen), v)
    top_p = torch.where(torch.rand(rows, generator=gen) < 0.6, torch.rand(rows, generator=gen) * 0.9 + 0.05, 1.0)
    min_p, top_k, top_p = min_p.to(device), top_k.to(device), top_p.float().to(device)
    out, ref = run_both(x, min_p, top_k, top_p, cap=32)
    assert_same_filtering(out, ref, x, min_p, top_k, top_p)


def test_flat_rows_with_wide_nuclei(device, poison_empty):
    """Nearly flat rows: top-p cuts through the bulk, hundreds of tokens above a cap of 16, so
    the narrowing carries real mass below its interval into the final in-register search."""
    v = 1000
    x = shifted_logits(3, v, seed=9, scale=0.3, device=device)
    min_p, top_k, top_p = params([0.0, 0.0, 0.3], [v, 600, v], [0.5, 0.7, 0.6], device)
    out, ref = run_both(x, min_p, top_k, top_p, cap=16)
    assert ((out > NEG).sum(-1) > 200).all()
    assert_same_filtering(out, ref, x, min_p, top_k, top_p)


def test_filter_edge_values(device):
    """top_k=1 and top_k=V-1; min_p=1 keeps the max only; a tiny top_p keeps the max only;
    top_p just below 1 drops only the underflowing tail (none here)."""
    v = 1000
    x = shifted_logits(5, v, seed=4, device=device)
    min_p, top_k, top_p = params([0.0, 0.0, 1.0, 0.0, 0.0], [1, v - 1, v, v, v], [1.0, 1.0, 1.0, 1e-9, 0.99999], device)
    out, ref = run_both(x, min_p, top_k, top_p, cap=16)
    assert (out > NEG).sum(-1).tolist()[:4] == [1, v - 1, 1, 1]
    assert_same_filtering(out, ref, x, min_p, top_k, top_p)


def test_grammar_masked_rows(device):
    """-inf from a grammar mask: top_k above the allowed count is a no-op (the torch path's
    k-th value is -inf); top-p and min-p see only the allowed tokens."""
    v = 1000
    x = shifted_logits(4, v, seed=5, device=device)
    allowed = torch.rand(4, v, generator=torch.Generator().manual_seed(6)).to(device) < 0.05
    allowed[:, 0] = True
    x = torch.where(allowed, x, NEG)
    x = x - x.amax(-1, keepdim=True)
    min_p, top_k, top_p = params([0.0, 0.1, 0.0, 0.0], [900, 5, 20, v], [1.0, 0.9, 0.6, 0.95], device)
    out, ref = run_both(x, min_p, top_k, top_p, cap=16)
    assert torch.equal(out[0], x[0])
    assert_same_filtering(out, ref, x, min_p, top_k, top_p)


def test_ties(device):
    """Logits on a coarse grid tie by the dozen. top-k keeps every value tied with the k-th,
    as the torch path; top-p keeps a tie group whole (the torch path keeps part of a group
    it splits), so the kernel keeps exactly the values >= the smallest value torch keeps.
    Equal rows with -0.0 and +0.0 count as one value."""
    v = 1000
    x = torch.round(shifted_logits(4, v, seed=7, device=device) * 2) / 2
    x[3] = 0.0
    x[3, ::2] = -0.0
    min_p, top_k, top_p = params([0.0, 0.0, 0.05, 0.0], [25, v, 60, 3], [1.0, 0.7, 0.8, 0.5], device)
    out, ref = run_both(x, min_p, top_k, top_p, cap=16)
    kept, rkept = out > NEG, ref > NEG
    assert torch.equal(kept[0], rkept[0]) and kept[0].sum() > 25          # ties with the 25th kept
    for r in (1, 2):
        lowest = x[r][rkept[r]].min()
        assert torch.equal(kept[r], rkept[r] | (x[r] >= lowest))
    assert kept[3].all()                                                  # one value: nothing to cut
    assert_same_filtering(out, ref, x, min_p, top_k, top_p)


def test_rejects_bad_arguments(device):
    x = torch.zeros(2, 100, device=device)
    mp, tk, tp = params([0.0, 0.0], [5, 5], [1.0, 1.0], device)
    with pytest.raises(ValueError, match="x must be float32"):
        sampling_filters_(x.bfloat16(), mp, tk, tp)
    with pytest.raises(ValueError, match="top_p must be"):
        sampling_filters_(x, mp, tk, tp[:1])
    with pytest.raises(ValueError, match="cap=24"):
        sampling_filters_(x, mp, tk, tp, cap=24)


def test_sampler_draws_the_same_tokens_on_both_backends(monkeypatch):
    """Seeded rows through Sampler: the filters on the Triton kernel (interpreter) and on the
    torch path give identical tokens for the same exponential-race noise."""
    v = 1000
    logits = shifted_logits(4, v, seed=8) + 1.0
    kinds = [{"top_k": 20}, {"top_p": 0.8, "temperature": 0.7}, {"min_p": 0.05, "top_k": 50, "top_p": 0.9},
             {"temperature": 1.2}]
    rows = [SamplingRow(SamplingParams(seed=11 + i, **kw), [1], [3] * i) for i, kw in enumerate(kinds)]
    tokens = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", name)
        tokens[name] = [Sampler(v, {2}, seed=0)(logits, rows).token_ids for _ in range(2)]
    assert tokens["torch"] == tokens["triton"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows,vocab", [(1, 129280), (64, 129280), (256, 129280), (64, 151936)])
def test_filters_gpu_sizes(rows, vocab):
    """Real vocabularies: a mix of typical settings per row; the launch must not sync."""
    gen = torch.Generator().manual_seed(rows)
    temps = torch.rand(rows, 1, generator=gen) + 0.5
    x = (shifted_logits(rows, vocab, seed=rows + vocab) / temps).cuda()
    choice = torch.randint(0, 4, (rows,), generator=gen)
    min_p = torch.where(choice == 0, 0.05, 0.0)
    top_k = torch.where(choice == 1, 50, torch.where(choice == 3, 2000, vocab))
    top_p = torch.where(choice >= 2, 0.9, torch.where(choice == 0, 0.95, 1.0)).float()
    min_p, top_k, top_p = min_p.cuda(), top_k.cuda(), top_p.cuda()
    out, ref = x.clone(), x.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampling_filters_(out, min_p, top_k, top_p)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reference.sampling_filters_(ref, min_p, top_k, top_p)
    assert_same_filtering(out, ref, x, min_p, top_k, top_p)
