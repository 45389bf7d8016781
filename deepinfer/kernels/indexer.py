"""Lightning-indexer scores over candidate slots in a paged key cache;
reference: :func:`reference.indexer_scores`.

``score[t, n] = sum_h w[t, h] * relu(q[t, h] . k[slots[t, n]]) * scale`` in float32,
-inf where the slot is -1. The key cache is ``[NB, bs, nt, 1, Di]``, a strided view
into a page buffer shared by many layers: key s sits at
``base + (s // bs) * stride(0) + (s % bs) * stride(1)`` (tensor 0).

Grid (T, splits). A program loads token t's Hi query heads once ([Hi, Di], padded
to a tensor-core tile) and walks its run of the token's candidates in tiles of
BLOCK_N slots: one gathered key tile [BLOCK_N, Di] times q^T gives all heads' dots
[BLOCK_N, Hi] in one product; relu, the weighted head sum and the scale follow in
registers. Tiles past the last real slot of a run are not gathered, only set to
-inf, so rows padded to the longest context cost what their real candidates cost.
Splitting a token's candidates keeps the GPU busy when T is small
(decode over long contexts); for prefill one run per token loads q once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl


@triton.jit
def _indexer_kernel(
    q_ptr, w_ptr, cache_ptr, slots_ptr, out_ptr,
    n, num_heads, head_dim, tiles_per_split, scale,
    stride_q_t, stride_q_h, stride_w_t, stride_w_h, stride_slots_t, stride_slots_n,
    stride_cache_block, stride_cache_offset, stride_out_t,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    heads = tl.arange(0, BLOCK_HI)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < num_heads
    q = tl.load(q_ptr + token * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
                mask=head_ok[:, None] & (dims[None, :] < head_dim), other=0.0)  # [BLOCK_HI, BLOCK_D]
    # The scale folds into the head weights (padding heads weigh 0).
    w = tl.load(w_ptr + token * stride_w_t + heads * stride_w_h, mask=head_ok, other=0.0) * scale
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, n)
    # Candidates past the run's last real slot (rows padded to the longest context's
    # entry count) only get -inf: find it first, a cheap scan next to gathering keys.
    last = lo - 1
    for n0 in range(lo, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + token * stride_slots_t + j * stride_slots_n, mask=j < hi, other=-1)
        last = tl.maximum(last, tl.max(tl.where(slot >= 0, j, lo - 1), axis=0))
    for n0 in range(lo, last + 1, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)                                           # [BLOCK_N]
        in_run = j < hi
        slot = tl.load(slots_ptr + token * stride_slots_t + j * stride_slots_n,
                       mask=in_run, other=-1).to(tl.int64)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
        k = tl.load(cache_ptr + row[:, None] + dims[None, :],
                    mask=valid[:, None] & (dims[None, :] < head_dim), other=0.0)  # [BLOCK_N, BLOCK_D]
        dots = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)             # [BLOCK_N, BLOCK_HI]
        score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)               # [BLOCK_N]
        score = tl.where(valid, score, float("-inf"))
        tl.store(out_ptr + token * stride_out_t + j, score, mask=in_run)
    tail = tl.cdiv(last + 1 - lo, BLOCK_N) * BLOCK_N + lo                       # first tile not scored
    for n0 in range(tail, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + token * stride_out_t + j, tl.full([BLOCK_N], float("-inf"), tl.float32),
                 mask=j < hi)


@dataclass(frozen=True)
class IndexerConfig:
    """Tile config of one launch: BLOCK_N candidates per tile, ``num_splits`` runs of tiles
    per token, and the launch's warps and pipeline stages."""
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(q: torch.Tensor, n: int) -> IndexerConfig:
    """The launcher's choice for q [T, Hi, Di] over N candidates per token.

    BLOCK_N = 64 candidates: the key tile is the MMA's M side, 64 rows fill a Hopper
    warpgroup (4 warps); [64, Hi = 64] float32 dots take 32 registers a thread. Splits: about
    four programs per SM over all tokens, each with two tiles at least; none off CUDA.
    """
    t = q.shape[0]
    block_n = 64
    num_splits = 1
    if q.is_cuda:
        num_splits = max(1, min(triton.cdiv(4 * _sm_count(q.device), t), triton.cdiv(n, block_n) // 2))
    return IndexerConfig(block_n, num_splits, num_warps=4, num_stages=3)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 keys (tests, exactness) must not fall back to TF32 tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def indexer_scores(
    q: torch.Tensor,               # [T, Hi, Di] indexer queries
    weights: torch.Tensor,         # [T, Hi] float32 per-head weights
    key_cache: torch.Tensor,       # [NB, bs, nt, 1, Di] indexer keys (tensor 0)
    slots: torch.Tensor,           # [T, N] candidate entry slots, -1 = none
    scale: float,
    config: IndexerConfig | None = None,
) -> torch.Tensor:                 # [T, N] float32, -inf where slot is -1
    """Lightning-indexer scores (see the module docstring); ``config`` overrides
    :func:`default_config`. No host synchronisation: the launch depends only on shapes."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"indexer_scores: q must be [T, Hi, Di] with Di contiguous, got shape "
                         f"{tuple(q.shape)} strides {q.stride()}")
    t, hi, di = q.shape
    if weights.shape != (t, hi) or weights.dtype != torch.float32:
        raise ValueError(f"indexer_scores: weights must be [T={t}, Hi={hi}] float32, got "
                         f"{weights.dtype} of shape {tuple(weights.shape)}")
    if key_cache.dim() != 5 or key_cache.shape[3] != 1 or key_cache.shape[4] != di:
        raise ValueError(f"indexer_scores: key_cache must be [NB, bs, nt, 1, Di={di}], got "
                         f"{tuple(key_cache.shape)}")
    if key_cache.stride(4) != 1:
        raise ValueError(f"indexer_scores: key_cache's last dim (Di) must be contiguous, got strides "
                         f"{key_cache.stride()}")
    if key_cache.dtype != q.dtype:
        raise ValueError(f"indexer_scores: q is {q.dtype} but key_cache is {key_cache.dtype}")
    if slots.dim() != 2 or slots.shape[0] != t or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indexer_scores: slots must be [T={t}, N] int32/int64, got {slots.dtype} "
                         f"of shape {tuple(slots.shape)}")
    if not (q.device == weights.device == key_cache.device == slots.device):
        raise ValueError(f"indexer_scores: q, weights, key_cache and slots must share a device, got "
                         f"{q.device}, {weights.device}, {key_cache.device}, {slots.device}")
    n = slots.shape[1]
    out = torch.empty(t, n, dtype=torch.float32, device=q.device)
    if t == 0 or n == 0:
        return out
    if config is None:
        config = default_config(q, n)
    tiles = triton.cdiv(n, config.block_n)
    tiles_per_split = triton.cdiv(tiles, config.num_splits)
    num_splits = triton.cdiv(tiles, tiles_per_split)       # no split left without a tile
    _indexer_kernel[(t, num_splits)](
        q, weights, key_cache, slots, out,
        n, hi, di, tiles_per_split, scale,
        q.stride(0), q.stride(1), weights.stride(0), weights.stride(1),
        slots.stride(0), slots.stride(1), key_cache.stride(0), key_cache.stride(1), out.stride(0),
        BLOCK_SIZE=key_cache.shape[1], BLOCK_N=config.block_n,
        BLOCK_HI=max(16, triton.next_power_of_2(hi)), BLOCK_D=max(16, triton.next_power_of_2(di)),
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl.flags(q.device))
    return out
