"""Top-k selection of candidate slots by score, one Triton program per row; reference:
:func:`reference.topk_slots`. Used by the lightning indexer (DeepSeek-V4).

Shapes: T rows, N candidates a row, K = min(topk, N) outputs a row.

A program loads its row's N scores into registers (padded to a power of two with
-inf) and finds the K-th largest value exactly, without sorting:

1. Scores map to int32 keys in the same order (the float bits, with the sign-magnitude
   negatives flipped; -0.0 folded onto +0.0, as they compare equal).
2. The threshold ``t``, the largest key with ``count(key >= t) >= K``, is built one bit
   at a time from the top (the sign bit first, then bits 30..0): up to 32 counting
   passes, each one reduction over the row in registers. The search stops early once
   exactly K keys are ``>= t``: that t keeps the same K candidates (with distinct scores
   this comes after the bits that separate the K-th from the (K+1)-th key, about half
   the passes at N = 1024, K = 512). A row with at most K visible scores skips the
   search and keeps all of them.
3. The kept candidates are those above ``t``, then those equal to ``t`` in candidate
   order until K are kept (a cumulative sum ranks the ties); a second cumulative sum
   gives each kept candidate its output position.

Output: the kept slots in candidate order (not by score: the sparse attention that reads
them does not depend on the order), then -1 where a row has fewer than K visible scores.
A score is visible when it is > -inf; NaN counts as -inf (torch.topk would rank NaN
first). With no tie at the K-th value the set equals torch.topk's; with ties the first
tied candidates are kept, so the result is deterministic.

No host synchronisation: the grid is (T,), fixed by shapes (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

# Above this a row no longer fits one program's registers (32 scores a thread at 16
# warps); callers take torch.topk there.
MAX_CANDIDATES = 16384


@triton.jit
def _ordered_key(x):
    """float32 -> int32 in the same order; -0.0 folded onto +0.0. Integer operations only,
    so subnormals keep their order whatever the float mode (flush to zero)."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where(b == -2147483648, 0, b)                         # -0.0
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _topk_slots_kernel(
    scores_ptr, slots_ptr, out_ptr,
    n, k, stride_scores_t, stride_slots_t, stride_slots_n, stride_out_t,
    BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    in_row = j < n
    x = tl.load(scores_ptr + row * stride_scores_t + j, mask=in_row, other=float("-inf"))
    visible = x > float("-inf")                                  # False for NaN
    neg_inf_key = _ordered_key(tl.full([], float("-inf"), tl.float32))
    key = tl.where(visible, _ordered_key(x), neg_inf_key)        # [BLOCK] int32
    n_visible = tl.sum(visible.to(tl.int32), axis=0)

    # Threshold: the K-th largest key; with at most K visible scores, below every one of them.
    t = neg_inf_key
    if n_visible > k:
        count = tl.sum((key >= 0).to(tl.int32), axis=0)
        t = tl.where(count >= k, 0, -2147483648)
        i = 0
        # Once exactly K keys are >= t, t selects the same K as the K-th largest key would:
        # stop there (distinct scores get there after about 32 - log2(key gap) bits).
        while (i < 31) & (count != k):
            # Within one sign, setting a lower bit raises a two's-complement value.
            cand = t | (1 << (30 - i))
            count = tl.sum((key >= cand).to(tl.int32), axis=0)
            t = tl.where(count >= k, cand, t)
            i += 1

    above = key > t
    tie = visible & (key == t)
    need = k - tl.sum(above.to(tl.int32), axis=0)                # ties to keep, >= 0
    keep = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= need))
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    slot = tl.load(slots_ptr + row * stride_slots_t + j * stride_slots_n, mask=keep)
    out_row = out_ptr + row * stride_out_t
    tl.store(out_row + pos, slot, mask=keep)
    n_kept = tl.minimum(n_visible, k)
    tl.store(out_row + j, tl.full([BLOCK], -1, out_ptr.dtype.element_ty), mask=(j >= n_kept) & (j < k))


def topk_slots(
    scores: torch.Tensor,          # [T, N] float32, -inf (or NaN) for invisible candidates
    slots: torch.Tensor,           # [T, N] int32/int64 candidate slots
    topk: int,
    num_warps: int | None = None,
) -> torch.Tensor:                 # [T, min(topk, N)] in slots' dtype, -1 past the visible ones
    """The slots of each row's ``topk`` largest scores, in candidate order (see the module
    docstring); ``num_warps`` overrides the launcher's choice. N must be at most
    :data:`MAX_CANDIDATES`."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"topk_slots: scores must be [T, N] float32 with N contiguous, got "
                         f"{scores.dtype} of shape {tuple(scores.shape)} strides {scores.stride()}")
    if slots.shape != scores.shape or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_slots: slots must be int32/int64 of the scores' shape "
                         f"{tuple(scores.shape)}, got {slots.dtype} of shape {tuple(slots.shape)}")
    if scores.device != slots.device:
        raise ValueError(f"topk_slots: scores on {scores.device} but slots on {slots.device}")
    if topk < 0:
        raise ValueError(f"topk_slots: topk must be >= 0, got {topk}")
    t, n = scores.shape
    if n > MAX_CANDIDATES:
        raise ValueError(f"topk_slots: {n} candidates a row exceed the kernel's limit of {MAX_CANDIDATES}")
    k = min(topk, n)
    out = torch.empty(t, k, dtype=slots.dtype, device=scores.device)
    if t == 0 or k == 0:
        return out
    # Tile config: the whole row in one block; one warp per 512 candidates (16 scores a
    # thread, 32 at 16384), 1 to 16 warps: the 32 counting passes are reductions, cheaper
    # over fewer warps.
    block = triton.next_power_of_2(n)
    if num_warps is None:
        num_warps = min(16, max(1, block // 512))
    _topk_slots_kernel[(t,)](
        scores, slots, out, n, k, scores.stride(0), slots.stride(0), slots.stride(1), out.stride(0),
        BLOCK=block, num_warps=num_warps, **pdl.flags(scores.device))
    return out
