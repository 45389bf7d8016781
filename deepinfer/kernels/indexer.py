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

Token blocks (prefill). The tokens of one prompt see runs of the same keys (each token a
prefix of its sequence's compressed entries, longer by one entry every r tokens), so one
program per token gathers every key about T / r times over: at T = 4096 (r = 4) that
gather, not the tensor-core work, set the kernel's time. Given ``groups`` ([T] ids; tokens
of one id have candidate rows that agree wherever both are >= 0, as the rows of one
sequence do), a program of :func:`_indexer_block_kernel` takes BLOCK_T consecutive tokens:
one gathered key tile [BLOCK_N, Di] times their queries [BLOCK_T * Hi, Di]^T gives
[BLOCK_N, BLOCK_T * Hi] dots, so each key is loaded once a block and the product is
BLOCK_T times wider. Column j's key is the slot the block's tokens agree on (their
largest, -1 being smaller than any slot); token t scores it only where its own slot is
>= 0. A block that straddles two sequences takes one pass per id, each with its own
slots; ids are read on the device (no host synchronisation). Blocks run last first:
later tokens of a prompt see more keys, and starting the longest ones first shortens
the kernel's tail.

Packed keys (DeepSeek-V4.1's MXFP4 index keys, ``kv_records.py``): with ``key_format`` the
key cache holds uint8 records of ``record_bytes(fmt, Di)`` bytes, decoded in registers on
load (float32 values times their scales) and cast to q's dtype (exactly, in bfloat16 or float32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.kv_records import PLAIN, format_id, load_record_rows
from deepinfer.kernels.launch import sm_count
from deepinfer.kv_spec import record_bytes


@triton.jit
def _load_keys(cache_ptr, row, dims, mask, head_dim, q, KEY_FMT: tl.constexpr):
    """The key tile [N, BLOCK_D] at element offsets ``row`` [N], in q's dtype: the cache's values
    (PLAIN), or its records decoded (kv_records.py)."""
    if KEY_FMT == PLAIN:
        return tl.load(cache_ptr + row[:, None] + dims[None, :], mask=mask, other=0.0)
    return load_record_rows(cache_ptr, row, dims, mask, head_dim, KEY_FMT).to(q.dtype)


@triton.jit
def _indexer_kernel(
    q_ptr, w_ptr, cache_ptr, slots_ptr, out_ptr,
    n, num_heads, head_dim, tiles_per_split, scale,
    stride_q_t, stride_q_h, stride_w_t, stride_w_h, stride_slots_t, stride_slots_n,
    stride_cache_block, stride_cache_offset, stride_out_t,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, KEY_FMT: tl.constexpr = 0, PDL: tl.constexpr = False,
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
        k = _load_keys(cache_ptr, row, dims, valid[:, None] & (dims[None, :] < head_dim), head_dim, q,
                       KEY_FMT)                                                  # [BLOCK_N, BLOCK_D]
        dots = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)             # [BLOCK_N, BLOCK_HI]
        score = tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)               # [BLOCK_N]
        score = tl.where(valid, score, float("-inf"))
        tl.store(out_ptr + token * stride_out_t + j, score, mask=in_run)
    tail = tl.cdiv(last + 1 - lo, BLOCK_N) * BLOCK_N + lo                       # first tile not scored
    for n0 in range(tail, hi, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + token * stride_out_t + j, tl.full([BLOCK_N], float("-inf"), tl.float32),
                 mask=j < hi)


@triton.jit
def _indexer_block_kernel(
    q_ptr, w_ptr, cache_ptr, slots_ptr, groups_ptr, out_ptr,
    t, n, num_heads, head_dim, tiles_per_split, scale,
    stride_q_t, stride_q_h, stride_w_t, stride_w_h, stride_slots_t, stride_slots_n,
    stride_cache_block, stride_cache_offset, stride_out_t,
    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_HI: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, KEY_FMT: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    block = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)          # the last block first
    split = tl.program_id(1)
    toks = block * BLOCK_T + tl.arange(0, BLOCK_T)                              # [BLOCK_T]
    tok_ok = toks < t
    # Query rows: token i's head h at row i * BLOCK_HI + h.
    rows = tl.arange(0, BLOCK_T * BLOCK_HI)
    row_tok = block * BLOCK_T + rows // BLOCK_HI
    row_head = rows % BLOCK_HI
    row_ok = (row_tok < t) & (row_head < num_heads)
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + row_tok[:, None] * stride_q_t + row_head[:, None] * stride_q_h + dims[None, :],
                mask=row_ok[:, None] & (dims[None, :] < head_dim), other=0.0)  # [BLOCK_T * BLOCK_HI, BLOCK_D]
    # The scale folds into the head weights (padding heads and tokens weigh 0).
    w = tl.load(w_ptr + row_tok * stride_w_t + row_head * stride_w_h, mask=row_ok, other=0.0) * scale
    group = tl.load(groups_ptr + toks, mask=tok_ok, other=0)
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(lo + tiles_per_split * BLOCK_N, n)
    slot_rows = slots_ptr + toks[None, :] * stride_slots_t                     # [1, BLOCK_T]
    out_rows = out_ptr + toks[None, :] * stride_out_t
    index = tl.arange(0, BLOCK_T)
    todo = tok_ok
    # One pass per id among the block's tokens: one pass within a sequence.
    while tl.max(todo.to(tl.int32), axis=0) > 0:
        first = tl.min(tl.where(todo, index, BLOCK_T), axis=0)
        sel = todo & (group == tl.sum(tl.where(index == first, group, 0), axis=0))  # [BLOCK_T]
        todo = todo & ~sel
        # The last column any selected token sees: later tiles are only set to -inf.
        last = lo - 1
        for n0 in range(lo, hi, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            s = tl.load(slot_rows + j[:, None] * stride_slots_n, mask=sel[None, :] & (j[:, None] < hi),
                        other=-1)
            last = tl.maximum(last, tl.max(tl.max(tl.where(s >= 0, j[:, None], lo - 1), axis=1), axis=0))
        for n0 in range(lo, last + 1, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)                                       # [BLOCK_N]
            in_run = j < hi
            s = tl.load(slot_rows + j[:, None] * stride_slots_n, mask=sel[None, :] & in_run[:, None],
                        other=-1)                                                # [BLOCK_N, BLOCK_T]
            seen = s >= 0
            slot = tl.max(s, axis=1).to(tl.int64)                                # [BLOCK_N] shared slot
            valid = slot >= 0
            slot = tl.where(valid, slot, 0)
            row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
            k = _load_keys(cache_ptr, row, dims, valid[:, None] & (dims[None, :] < head_dim), head_dim, q,
                           KEY_FMT)                                              # [BLOCK_N, BLOCK_D]
            dots = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)      # [BLOCK_N, BLOCK_T * BLOCK_HI]
            dots = tl.maximum(dots, 0.0) * w[None, :]
            score = tl.sum(tl.reshape(dots, [BLOCK_N, BLOCK_T, BLOCK_HI]), axis=2)   # [BLOCK_N, BLOCK_T]
            score = tl.where(seen, score, float("-inf"))
            tl.store(out_rows + j[:, None], score, mask=sel[None, :] & in_run[:, None])
        tail = tl.cdiv(last + 1 - lo, BLOCK_N) * BLOCK_N + lo                   # first tile not scored
        for n0 in range(tail, hi, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            tl.store(out_rows + j[:, None], tl.full([BLOCK_N, BLOCK_T], float("-inf"), tl.float32),
                     mask=sel[None, :] & (j[:, None] < hi))


@dataclass(frozen=True)
class IndexerConfig:
    """Tile config of one launch: BLOCK_N candidates per tile, ``num_splits`` runs of tiles
    per token (block), the launch's warps and pipeline stages, and ``block_t`` tokens a
    program: 1 is the per-token kernel; more takes :func:`_indexer_block_kernel`, which needs
    the caller's ``groups``."""
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    block_t: int = 1

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"IndexerConfig: block_n must be a power of two >= 16 (a tensor-core "
                             f"tile side), got {self.block_n}")
        if self.block_t < 1 or self.block_t & (self.block_t - 1):
            raise ValueError(f"IndexerConfig: block_t must be a power of two >= 1, got {self.block_t}")
        if self.num_splits < 1:
            raise ValueError(f"IndexerConfig: num_splits must be >= 1, got {self.num_splits}")


def _block_hi(hi: int) -> int:
    return max(16, triton.next_power_of_2(hi))


# Query rows of a token block's product ([BLOCK_T * Hi, Di]): 256 is the widest wgmma N side;
# at Hi = 64 that is 4 tokens, whose [64, 256] float32 dots take 64 registers a thread at 8 warps.
BLOCK_ROWS = 256


def default_config(q: torch.Tensor, n: int, grouped: bool = False) -> IndexerConfig:
    """The launcher's choice for q [T, Hi, Di] over N candidates per token; ``grouped``: the
    caller passes ``groups`` (token blocks are possible).

    Per token: BLOCK_N = 64 candidates, the key tile is the MMA's M side, 64 rows fill a
    Hopper warpgroup (4 warps); [64, Hi = 64] float32 dots take 32 registers a thread.
    Grouped: BLOCK_ROWS / Hi tokens a block (fewer when T is smaller), 4 warps (253 registers a
    thread, no spills, the key gather pipelined at 3 stages: scripts/probes/sm90_resources.py).
    H200, T=4096 (measured 2026-12-04): one 4096-token prompt 153.5 us
    against 214.7 for the per-token kernel and 243.3 at 8 warps; four 1024-token prompts 71.9
    against 81.3 and 95.0.
    Splits: about four programs per SM over all tokens (blocks), each with two tiles at least;
    none off CUDA.
    """
    t = q.shape[0]
    block_n = 64
    block_t = 1
    if grouped:
        block_t = min(max(1, BLOCK_ROWS // _block_hi(q.shape[1])), triton.next_power_of_2(t))
    programs = triton.cdiv(t, block_t)
    num_splits = 1
    if q.is_cuda:
        num_splits = max(1, min(triton.cdiv(4 * sm_count(q.device), programs), triton.cdiv(n, block_n) // 2))
    return IndexerConfig(block_n, num_splits, num_warps=4, num_stages=3, block_t=block_t)


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
    groups: torch.Tensor | None = None,   # [T] int ids: rows of one id agree where both are >= 0
    key_format: str | None = None,        # None (values of q's dtype) or the keys' record format
) -> torch.Tensor:                 # [T, N] float32, -inf where slot is -1
    """Lightning-indexer scores (see the module docstring); ``config`` overrides
    :func:`default_config`. With ``key_format`` the key cache is a packed record cache (uint8
    ``[NB, bs, nt, 1, record_bytes(key_format, Di)]``). ``groups`` lets tokens of one id share key loads (token blocks);
    the caller vouches that their candidate rows agree wherever both are >= 0 (the rows of
    one sequence's tokens from :func:`paged_slots.paged_slots` do), else the scores are
    wrong. No host synchronisation: the launch depends only on shapes."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"indexer_scores: q must be [T, Hi, Di] with Di contiguous, got shape "
                         f"{tuple(q.shape)} strides {q.stride()}")
    t, hi, di = q.shape
    if weights.shape != (t, hi) or weights.dtype != torch.float32:
        raise ValueError(f"indexer_scores: weights must be [T={t}, Hi={hi}] float32, got "
                         f"{weights.dtype} of shape {tuple(weights.shape)}")
    format_id(key_format)
    row, dtype = (di, q.dtype) if key_format is None else (record_bytes(key_format, di), torch.uint8)
    what = f"Di={di}" if key_format is None else f"{key_format} record of Di={di}: {row} bytes"
    if key_cache.dim() != 5 or key_cache.shape[3] != 1 or key_cache.shape[4] != row:
        raise ValueError(f"indexer_scores: key_cache must be [NB, bs, nt, 1, {what}], got "
                         f"{tuple(key_cache.shape)}")
    if key_cache.stride(4) != 1:
        raise ValueError(f"indexer_scores: key_cache's last dim must be contiguous, got strides "
                         f"{key_cache.stride()}")
    if key_cache.dtype != dtype:
        raise ValueError(f"indexer_scores: key_cache is {key_cache.dtype}; with q {q.dtype} and "
                         f"key_format={key_format} it must be {dtype}")
    if slots.dim() != 2 or slots.shape[0] != t or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indexer_scores: slots must be [T={t}, N] int32/int64, got {slots.dtype} "
                         f"of shape {tuple(slots.shape)}")
    if not (q.device == weights.device == key_cache.device == slots.device):
        raise ValueError(f"indexer_scores: q, weights, key_cache and slots must share a device, got "
                         f"{q.device}, {weights.device}, {key_cache.device}, {slots.device}")
    if groups is not None and (groups.shape != (t,) or groups.dtype not in (torch.int32, torch.int64)
                               or groups.device != q.device or groups.stride(0) != 1):
        raise ValueError(f"indexer_scores: groups must be a contiguous [T={t}] int32/int64 tensor on "
                         f"{q.device}, got {groups.dtype} of shape {tuple(groups.shape)} on {groups.device}")
    n = slots.shape[1]
    out = torch.empty(t, n, dtype=torch.float32, device=q.device)
    if t == 0 or n == 0:
        return out
    if config is None:
        config = default_config(q, n, groups is not None)
    if config.block_t * _block_hi(hi) > BLOCK_ROWS:
        # Measured on the H200 (triton 3.6): 8 tokens x 64 heads gave wrong scores (max error
        # 3.95 on scores of 4); the products stay within one wgmma's N side.
        raise ValueError(f"indexer_scores: block_t={config.block_t} x {_block_hi(hi)} head rows "
                         f"exceeds {BLOCK_ROWS} query rows a product")
    if config.block_t > 1 and groups is None:
        raise ValueError(f"indexer_scores: block_t={config.block_t} needs groups (which tokens share "
                         "candidate rows)")
    tiles = triton.cdiv(n, config.block_n)
    tiles_per_split = triton.cdiv(tiles, config.num_splits)
    num_splits = triton.cdiv(tiles, tiles_per_split)       # no split left without a tile
    common = dict(BLOCK_SIZE=key_cache.shape[1], BLOCK_N=config.block_n, BLOCK_HI=_block_hi(hi),
                  BLOCK_D=max(16, triton.next_power_of_2(di)), DOT_PRECISION=_dot_precision(q.dtype),
                  KEY_FMT=format_id(key_format), num_warps=config.num_warps, num_stages=config.num_stages)
    strides = (q.stride(0), q.stride(1), weights.stride(0), weights.stride(1),
               slots.stride(0), slots.stride(1), key_cache.stride(0), key_cache.stride(1), out.stride(0))
    if config.block_t > 1:
        _indexer_block_kernel[(triton.cdiv(t, config.block_t), num_splits)](
            q, weights, key_cache, slots, groups, out, t, n, hi, di, tiles_per_split, scale, *strides,
            BLOCK_T=config.block_t, **common, **pdl.flags(q.device))
    else:
        _indexer_kernel[(t, num_splits)](
            q, weights, key_cache, slots, out, n, hi, di, tiles_per_split, scale, *strides, **common,
            **pdl.flags(q.device))
    return out
