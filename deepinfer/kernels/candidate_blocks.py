"""DeepSeek-V4.1 candidate blocks: which keys a reindex layer may select; reference:
:func:`reference.candidate_block_mask`.

Per row (query token) the N keys are cut into runs of ``block`` keys (the last one short when
``block`` does not divide N); a run scores its best key, the run holding the newest visible
key (``visible - 1``) scores +inf, and the ``num_blocks`` best runs that hold a visible key
(score > -inf) are kept. The mask is True on every key of a kept run.

Two launches, both with grids fixed by the shapes (no host synchronisation: CUDA-graph
capturable):

1. ``_block_max_kernel``, grid (T, ceil(NB / BLOCK_B)): each program reduces BLOCK_B runs
   of its row to their maxima (the newest run pinned to +inf) into a float32 scratch row of NB.
2. ``_keep_blocks_kernel``, grid (T,): finds the K-th largest run score (K = min(num_blocks,
   NB)) by the counting search of ``topk.py`` (order-preserving int32 keys, one bit at a time
   from the top, stopping once exactly K keys are at or above the threshold), each count a
   loop over the row's runs in chunks of BLOCK_B, so rows of any length fit (the release's
   ratio-1 stream has a run per 8 tokens of context). It then writes the mask, chunk by
   chunk: runs above the threshold, and runs equal to it in run order until K are kept (a
   running count carries the ties across chunks). A row with at most K visible runs skips
   the search.

The kept set equals ``torch.topk``'s whenever no two runs tie at the K-th score; with ties the
earliest runs are kept, so the result is deterministic (torch.topk leaves it to the
implementation). NaN scores count as -inf.

Shapes: T rows, N keys a row, NB = ceil(N / block) runs, K = min(num_blocks, NB).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.topk import _ordered_key

# Runs one program holds at a time: 1024 float32 keys, 8 registers a thread at 4 warps, so a
# row of 16384 runs (131072 tokens of a ratio-1 stream) is 16 chunks a counting pass.
_BLOCKS_PER_CHUNK = 1024
# Keys one block-max program loads (runs x keys per run).
_TILE_ELEMS = 4096


@triton.jit
def _block_max_kernel(
    scores_ptr, visible_ptr, runs_ptr,
    n_keys, n_runs, stride_scores_t, stride_runs_t,
    BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)                       # [BLOCK_B] runs
    i = tl.arange(0, BLOCK_P2)
    key = b[:, None] * BLOCK + i[None, :]                                       # [BLOCK_B, BLOCK_P2]
    ok = (i[None, :] < BLOCK) & (key < n_keys)
    x = tl.load(scores_ptr + row * stride_scores_t + key, mask=ok, other=float("-inf"))
    x = tl.where(x == x, x, float("-inf"))                                      # NaN: -inf
    best = tl.max(x, axis=1)                                                    # [BLOCK_B]
    visible = tl.load(visible_ptr + row).to(tl.int64)
    newest = tl.where(visible > 0, (visible - 1) // BLOCK, -1)
    best = tl.where(b == newest, float("inf"), best)
    tl.store(runs_ptr + row * stride_runs_t + b, best, mask=b < n_runs)


@triton.jit
def _count_at_least(runs_row, n_runs, threshold, BLOCK_B: tl.constexpr):
    """How many of the row's run keys are >= threshold (int32)."""
    count = 0
    for b0 in range(0, n_runs, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        x = tl.load(runs_row + b, mask=b < n_runs, other=float("-inf"))
        count += tl.sum(((_ordered_key(x) >= threshold) & (b < n_runs)).to(tl.int32), axis=0)
    return count


@triton.jit
def _keep_blocks_kernel(
    runs_ptr, out_ptr,
    n_keys, n_runs, k, stride_runs_t, stride_out_t,
    BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    runs_row = runs_ptr + row * stride_runs_t
    neg_inf_key = _ordered_key(tl.full([], float("-inf"), tl.float32))
    # Visible runs: keys above -inf's.
    n_visible = _count_at_least(runs_row, n_runs, neg_inf_key + 1, BLOCK_B)

    # Threshold: the K-th largest key; with at most K visible runs, below every one of them.
    t = neg_inf_key
    if n_visible > k:
        count = _count_at_least(runs_row, n_runs, 0, BLOCK_B)
        t = tl.where(count >= k, 0, -2147483648)
        i = 0
        while (i < 31) & (count != k):
            cand = t | (1 << (30 - i))
            count = _count_at_least(runs_row, n_runs, cand, BLOCK_B)
            t = tl.where(count >= k, cand, t)
            i += 1
    n_above = _count_at_least(runs_row, n_runs, t + 1, BLOCK_B)    # t < INT32_MAX: +inf's key is below it
    need = k - n_above                                             # ties to keep, >= 0

    j = tl.arange(0, BLOCK_P2)
    ties_before = 0
    for b0 in range(0, n_runs, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        in_row = b < n_runs
        key = _ordered_key(tl.load(runs_row + b, mask=in_row, other=float("-inf")))
        visible = in_row & (key > neg_inf_key)
        tie = visible & (key == t)
        keep = (visible & (key > t)) | (tie & (ties_before + tl.cumsum(tie.to(tl.int32), axis=0) <= need))
        ties_before += tl.sum(tie.to(tl.int32), axis=0)
        col = b[:, None] * BLOCK + j[None, :]
        ok = (j[None, :] < BLOCK) & (col < n_keys)
        flag = tl.broadcast_to(keep[:, None], (BLOCK_B, BLOCK_P2)).to(tl.uint8)
        tl.store(out_ptr + row * stride_out_t + col, flag, mask=ok)


def candidate_block_mask(scores: torch.Tensor, visible: torch.Tensor, block: int, num_blocks: int) -> torch.Tensor:
    """[T, N] bool mask of each row's kept runs (see the module docstring).

    scores: [T, N] float32 index scores, -inf for invisible keys (N contiguous); visible: [T]
    int count of each row's visible keys (keys ``0 .. visible-1``); block >= 1 keys a run;
    num_blocks >= 0 runs kept a row (the newest counts among them).
    """
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"candidate_block_mask: scores must be [T, N] float32 with N contiguous, got "
                         f"{scores.dtype} of shape {tuple(scores.shape)} strides {scores.stride()}")
    t, n = scores.shape
    if visible.shape != (t,) or visible.dtype not in (torch.int32, torch.int64) or visible.device != scores.device:
        raise ValueError(f"candidate_block_mask: visible must be a [{t}] int32/int64 tensor on {scores.device}, "
                         f"got {visible.dtype} of shape {tuple(visible.shape)} on {visible.device}")
    if block < 1 or num_blocks < 0:
        raise ValueError(f"candidate_block_mask: block must be >= 1 and num_blocks >= 0, "
                         f"got block={block}, num_blocks={num_blocks}")
    out = torch.empty(t, n, dtype=torch.bool, device=scores.device)
    n_runs = -(-n // block)
    if num_blocks == 0:
        return out.zero_()
    if t == 0 or n == 0:
        return out
    runs = torch.empty(t, n_runs, dtype=torch.float32, device=scores.device)
    # Tile config: a run padded to a power of two; the block-max programs take as many runs as
    # fill _TILE_ELEMS keys, the keep pass chunks of _BLOCKS_PER_CHUNK runs (fewer for short
    # rows); 4 warps for both.
    block_p2 = triton.next_power_of_2(block)
    block_b = min(triton.next_power_of_2(n_runs), max(1, _TILE_ELEMS // block_p2))
    chunk = min(triton.next_power_of_2(n_runs), _BLOCKS_PER_CHUNK)
    _block_max_kernel[(t, triton.cdiv(n_runs, block_b))](
        scores, visible, runs, n, n_runs, scores.stride(0), runs.stride(0),
        BLOCK=block, BLOCK_P2=block_p2, BLOCK_B=block_b, num_warps=4,
        **pdl.flags(scores.device))
    _keep_blocks_kernel[(t,)](
        runs, out.view(torch.uint8), n, n_runs, min(num_blocks, n_runs), runs.stride(0), out.stride(0),
        BLOCK=block, BLOCK_P2=block_p2, BLOCK_B=chunk, num_warps=4,
        **pdl.flags(scores.device))
    return out
