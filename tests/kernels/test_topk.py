"""Top-k slot selection: the Triton kernel (deepinfer/kernels/topk.py) against
:func:`reference.topk_slots` (torch.topk). The kernel writes the kept slots in candidate
order, so rows are compared as sets; with ties at the k-th value any tied candidates may
be kept, so those rows are checked by counts and the threshold property instead."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.topk import MAX_CANDIDATES, topk_slots

NEG_INF = float("-inf")


def random_scores(t: int, n: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """[T, N] float32 of both signs, never zero, distinct within a row with near certainty."""
    x = torch.randn(t, n, generator=gen) * scale
    return torch.where(x == 0, 1.0, x)


def candidate_slots(t: int, n: int, gen: torch.Generator, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[T, N] distinct slots per row, so a slot names its candidate."""
    return torch.stack([torch.randperm(4 * n, generator=gen)[:n] for _ in range(t)]).to(dtype)


def check_selection(out: torch.Tensor, scores: torch.Tensor, slots: torch.Tensor, topk: int) -> None:
    """``out`` keeps min(topk, visible) distinct candidates a row, -1 after them, each scoring
    at least as high as every visible candidate left out; and equals the reference's set
    wherever the k-th value is not tied."""
    scores, slots, out = scores.cpu(), slots.cpu(), out.cpu()
    k = min(topk, scores.shape[1])
    assert out.shape == (scores.shape[0], k) and out.dtype == slots.dtype
    ref = reference.topk_slots(scores, slots, topk)
    for row in range(scores.shape[0]):
        x, s, picked = scores[row], slots[row], out[row]
        visible = x > NEG_INF                                        # NaN is never visible
        n_kept = min(k, int(visible.sum()))
        assert (picked[:n_kept] >= 0).all() and (picked[n_kept:] == -1).all(), f"row {row}: {picked}"
        kept = torch.isin(s, picked[:n_kept])
        assert int(kept.sum()) == n_kept, f"row {row}: slots repeated or not candidates"
        assert visible[kept].all(), f"row {row}: an invisible candidate kept"
        left = visible & ~kept
        if kept.any() and left.any():
            assert x[kept].min() >= x[left].max(), f"row {row}: a better candidate left out"
        kth = x[visible].sort(descending=True).values[n_kept - 1] if n_kept else None
        if kth is None or int((x[visible] == kth).sum()) == 1:
            assert sorted(picked.tolist()) == sorted(ref[row].tolist()), f"row {row}"


@pytest.mark.parametrize("topk", [1, 7, 64])
@pytest.mark.parametrize("n", [65, 150, 300])
def test_topk_slots_matches_reference(n, topk, device):
    """Random scores with -inf holes: rows with fewer visible candidates than topk (down to
    none), one row with exactly topk visible, N not a power of two."""
    gen = torch.Generator().manual_seed(n * 100 + topk)
    t = 7
    scores = random_scores(t, n, gen)
    scores[1] = NEG_INF                                              # nothing visible
    scores[2, topk // 2:] = NEG_INF                                  # fewer than topk
    scores[3, torch.randperm(n, generator=gen)[topk:]] = NEG_INF     # exactly topk
    scores[4, torch.rand(n, generator=gen) < 0.5] = NEG_INF          # scattered holes
    scores[5, : n - topk - 1] = NEG_INF                              # topk + 1, at the end
    slots = candidate_slots(t, n, gen)
    out = topk_slots(scores.to(device), slots.to(device), topk)
    check_selection(out, scores, slots, topk)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_topk_slots_more_than_candidates(slot_dtype, device):
    """topk >= N keeps every visible candidate: output width N, -1 after the visible ones."""
    gen = torch.Generator().manual_seed(2)
    scores = random_scores(3, 20, gen)
    scores[0, ::3] = NEG_INF
    slots = candidate_slots(3, 20, gen, slot_dtype)
    for topk in (20, 33):
        out = topk_slots(scores.to(device), slots.to(device), topk)
        check_selection(out, scores, slots, topk)


def test_topk_slots_signs_and_magnitudes(device):
    """The order-preserving key mapping: all-negative rows, mixed signs across many binades,
    subnormals, runs of adjacent floats (one ulp apart) of both signs, and +inf."""
    gen = torch.Generator().manual_seed(3)
    n, topk = 97, 13
    adjacent = (torch.arange(n, dtype=torch.int32) + torch.tensor(1.0).view(torch.int32)).view(torch.float32)
    binades = torch.exp2(torch.randint(-60, 60, (n,), generator=gen).float())
    scores = torch.stack([
        -random_scores(1, n, gen).abs()[0],                                      # all negative
        random_scores(1, n, gen)[0] * binades,
        random_scores(1, n, gen)[0].sign() * 1e-40 * torch.rand(n, generator=gen).add(0.1),  # subnormal
        torch.linspace(-3, 3, n),
        adjacent[torch.randperm(n, generator=gen)],
        -adjacent[torch.randperm(n, generator=gen)],
        random_scores(1, n, gen)[0],
    ])
    scores[6, [5, 40]] = float("inf")
    slots = candidate_slots(scores.shape[0], n, gen)
    out = topk_slots(scores.to(device), slots.to(device), topk)
    check_selection(out, scores, slots, topk)
    assert set(slots[6, [5, 40]].tolist()) <= set(out[6].tolist())


def test_topk_slots_ties(device):
    """Many equal values: exactly topk kept, each at least every one left out, and the same
    result on a second call."""
    gen = torch.Generator().manual_seed(4)
    t, n, topk = 6, 120, 20
    scores = torch.randint(-2, 3, (t, n), generator=gen).float()                    # 5 levels
    scores[1] = 0.5                                                                  # all tied
    scores[2, ::2] = NEG_INF
    scores[3] = torch.where(torch.rand(n, generator=gen) < 0.5, 0.0, -0.0)         # +0 == -0
    scores[4, :10] = 3.0                                                             # 10 above ties at 2
    slots = candidate_slots(t, n, gen, torch.int64)
    out = topk_slots(scores.to(device), slots.to(device), topk)
    check_selection(out, scores, slots, topk)
    assert torch.equal(out, topk_slots(scores.to(device), slots.to(device), topk))
    # The first tied candidates (in candidate order) are the ones kept; -0.0 ties with +0.0.
    for row in (1, 3):
        assert sorted(out[row].tolist()) == sorted(slots[row, :topk].tolist())


def test_topk_slots_candidate_order_reference(device):
    """The reference's ``candidate_order`` output (batch-invariant mode past the kernel's
    width) equals the kernel's exactly, ties and holes included, and a row's kept slots sit at
    the same places whatever its padded width (trailing -inf columns) and topk >= its count."""
    gen = torch.Generator().manual_seed(8)
    t, n, topk = 6, 90, 16
    scores = torch.randint(-3, 4, (t, n), generator=gen).float()                    # many ties
    scores[1, ::3] = NEG_INF                                                         # holes
    scores[2, 10:] = NEG_INF                                                         # 10 visible
    scores[3] = random_scores(1, n, gen)[0]
    slots = candidate_slots(t, n, gen, torch.int64)
    ref = reference.topk_slots(scores, slots, topk, earliest_ties=True, candidate_order=True)
    assert torch.equal(topk_slots(scores.to(device), slots.to(device), topk).cpu(), ref)
    padded = reference.topk_slots(torch.cat([scores, torch.full((t, 40), NEG_INF)], dim=1),
                                  torch.cat([slots, candidate_slots(t, 40, gen, torch.int64) + 4 * n], dim=1),
                                  topk, earliest_ties=True, candidate_order=True)
    assert torch.equal(padded, ref)
    wide = reference.topk_slots(scores[2:3], slots[2:3], 64, earliest_ties=True, candidate_order=True)
    assert torch.equal(wide[:, :10], ref[2:3, :10]) and (wide[:, 10:] == -1).all()
    by_score = reference.topk_slots(scores, slots, topk, earliest_ties=True)
    assert torch.equal(by_score.sort(dim=1).values, ref.sort(dim=1).values)
    assert not torch.equal(by_score, ref)


def test_topk_slots_nan_is_invisible(device):
    gen = torch.Generator().manual_seed(5)
    n, topk = 40, 8
    scores = random_scores(2, n, gen)
    scores[0, ::4] = float("nan")
    scores[1, : n - 3] = float("nan")                                                # 3 visible
    slots = candidate_slots(2, n, gen)
    out = topk_slots(scores.to(device), slots.to(device), topk).cpu()
    visible = ~scores.isnan()
    for row in range(2):
        assert not torch.isin(out[row], slots[row][~visible[row]]).any()
    assert (out[1, :3] >= 0).all() and (out[1, 3:] == -1).all()
    clean = scores.masked_fill(~visible, NEG_INF)
    check_selection(out, clean, slots, topk)


def test_topk_slots_strided_slots(device):
    """Slots read through a column slice of a wider tensor."""
    gen = torch.Generator().manual_seed(6)
    scores = random_scores(4, 50, gen)
    wide = candidate_slots(4, 80, gen)
    out = topk_slots(scores.to(device), wide.to(device)[:, 30:], 9)
    check_selection(out, scores, wide[:, 30:], 9)


def test_topk_slots_rejects_bad_inputs(device):
    scores = torch.randn(2, 10, device=device)
    slots = torch.arange(20, device=device).view(2, 10)
    with pytest.raises(ValueError, match="scores must be"):
        topk_slots(scores.half(), slots, 3)
    with pytest.raises(ValueError, match="slots must be"):
        topk_slots(scores, slots[:, :5], 3)
    with pytest.raises(ValueError, match="exceed"):
        wide = torch.randn(1, MAX_CANDIDATES + 1, device=device)
        topk_slots(wide, torch.zeros_like(wide, dtype=torch.int64), 3)


# --- DeepSeek-V4-Flash shapes (index_topk 512) on the GPU ------------------------------------------

def distinct_scores(t: int, n: int, device: torch.device) -> torch.Tensor:
    """[T, N] float32 of both signs, distinct within each row (no ties at any k)."""
    return (torch.rand(t, n, device=device).argsort(dim=1).float() - n / 2) * 0.37 + 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,n,prefill", [(4096, 1024, True), (16, 4096, False), (1, 4096, False),
                                         (4, 16384, False)])
def test_topk_slots_gpu_sizes(t, n, prefill):
    """Prefill: token p of one sequence sees (p + 1) // 4 entries, the rest are -inf; decode:
    every candidate visible. Sets equal the reference's row by row."""
    dev = torch.device("cuda")
    scores = distinct_scores(t, n, dev)
    if prefill:
        visible = torch.arange(n, device=dev)[None, :] < (torch.arange(t, device=dev)[:, None] + 1) // 4
        scores = scores.masked_fill(~visible, NEG_INF)
    slots = torch.randperm(4 * n, device=dev)[:n].int().expand(t, -1).contiguous()
    out = topk_slots(scores, slots, 512)
    ref = reference.topk_slots(scores, slots, 512)
    assert torch.equal(out.sort(dim=1).values, ref.sort(dim=1).values)
    assert torch.equal(out, topk_slots(scores, slots, 512))
