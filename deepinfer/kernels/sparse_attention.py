"""DeepSeek-V4 sparse attention over per-token key slots in paged caches;
reference: :func:`reference.sparse_attention`.

Each query token t attends to keys it names by flat slot (``block * bs + offset``,
-1 = no key) in one or two sources: the layer's sliding-window cache and, on
CSA/HCA layers, its compressed-entry cache. A cache is ``[NB, bs, nt, 1, D]``, a
strided view into a page buffer shared by many layers, so a key sits at
``base + block * stride(0) + offset * stride(1)`` (tensor 0, the one KV head);
that one vector is both K and V for all H query heads (MQA).

Grid (T, ceil(H / BLOCK_H), splits). A program holds BLOCK_H heads of one token
as the rows of a tensor-core tile and walks its share of the token's keys in
tiles of BLOCK_N slots: source 0's tiles, then source 1's, as one sequence of
tiles cut into ``splits`` equal runs. Each key tile is gathered once and used by
all BLOCK_H heads for both products (S = Q K^T over all of D, then P @ K), with
an online softmax in float32 and base-2 exponentials (log2(e) folded into the
scale). Leading and trailing runs of -1 slots are skipped, not computed on: a
row padded to a fixed width (top-k or every entry of the longest context) costs
what its real keys cost. At 64 heads x D = 512 the key loop runs at the register limit
(the float32 accumulator alone is 128 registers a thread at 8 warps), so masks that can be
dropped are: heads and dims when BLOCK_H divides H and D is BLOCK_D (EVEN_H, EVEN_D), the
guard for an all -inf row without splits, and the trimming scan is one load where it fits
(H200, T=4096, 64 x 512: window 128 + top-512 1,816 -> 1,643 us, window only 582 -> 470 us).

The sink logit seeds the running max and sum of split 0 (max = sink, sum = 1), so it
takes probability mass and adds no value, and a token with no key gets 0 / 1 = 0, as in
the reference.

Splitting the keys keeps the GPU busy at small T (decode): with one split there
are only T * H / BLOCK_H programs. With several, each split writes its partial
(max, sum, accumulator) and a second kernel merges them per (token, head).

Scores and softmax run in float32; P is rounded to the cache dtype before the
P @ V product (the flash-attention convention; exact for float32 caches).

Packed sources (DeepSeek-V4.1's KV records and DeepSeek-V4's ds_mla FP8 record,
``kv_records.py``): a source given a record
format (``formats``) is a uint8 cache of ``record_bytes(fmt, D)``-byte rows; each gathered
tile is decoded in registers (values times their block scales, float32) and cast to q's
dtype; bfloat16 and float32 hold every record value exactly (at most 6 significant bits, an
8-bit exponent; ds_mla's RoPE channels are bf16 values). The format is a constexpr per source, so a plain source compiles to the
load above.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer import env
from deepinfer.kernels import pdl
from deepinfer.kernels.kv_records import PLAIN, format_id, load_record_rows
from deepinfer.kernels.launch import sm_count
from deepinfer.kv_spec import record_bytes

_LOG2E = math.log2(math.e)


@triton.jit
def _attend_source(q, m, l, acc, cache_ptr, slots_ptr, token, k_lo, k_hi, dims, head_dim, qk_scale,
                   stride_slots_t, stride_slots_k, stride_cache_block, stride_cache_offset,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SCAN: tl.constexpr,
                   ONE_SCAN: tl.constexpr, SPLIT: tl.constexpr, EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   FMT: tl.constexpr):
    """Fold keys ``k_lo .. k_hi - 1`` of one source's slot row into the running (m, l, acc);
    FMT: the source's cache format (kv_records.py ids; PLAIN reads values of q's dtype)."""
    # Trim the leading and trailing runs of -1 (window slots before position 0, top-k
    # padding while a sequence has fewer entries than k): their tiles would cost two
    # products on nothing. ONE_SCAN: the range fits one BLOCK_SCAN-wide load (a prefill
    # row, a split's share). A scan loop costs registers even when it runs once (ptxas for
    # sm_90, 64 heads x 512: 264 vs 176 bytes of spill stack), and the key loop after it
    # runs at the register limit.
    if ONE_SCAN:
        jj = k_lo + tl.arange(0, BLOCK_SCAN)
        row_slots = tl.load(slots_ptr + token * stride_slots_t + jj * stride_slots_k,
                            mask=jj < k_hi, other=-1)
        first = tl.min(tl.where(row_slots >= 0, jj, k_hi), axis=0)
        last = tl.max(tl.where(row_slots >= 0, jj, k_lo - 1), axis=0)
    else:
        first = k_hi
        last = k_lo - 1
        for n0 in range(k_lo, k_hi, BLOCK_SCAN):
            jj = n0 + tl.arange(0, BLOCK_SCAN)
            row_slots = tl.load(slots_ptr + token * stride_slots_t + jj * stride_slots_k,
                                mask=jj < k_hi, other=-1)
            first = tl.minimum(first, tl.min(tl.where(row_slots >= 0, jj, k_hi), axis=0))
            last = tl.maximum(last, tl.max(tl.where(row_slots >= 0, jj, k_lo - 1), axis=0))
    first = k_lo + (first - k_lo) // BLOCK_N * BLOCK_N     # tiles on the row's BLOCK_N grid
    for n0 in range(first, last + 1, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)                                           # [BLOCK_N]
        slot = tl.load(slots_ptr + token * stride_slots_t + j * stride_slots_k,
                       mask=j <= last, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        # The block term in int64 (a page buffer can pass 2^31 elements); the offset within
        # a block is small. Fewer 64-bit registers in a loop that runs at the limit.
        row = ((slot // BLOCK_SIZE).to(tl.int64) * stride_cache_block
               + (slot % BLOCK_SIZE).to(tl.int32) * stride_cache_offset)
        kv_mask = valid[:, None] & (dims[None, :] < head_dim) if not EVEN_D else valid[:, None]
        if FMT == PLAIN:
            kv = tl.load(cache_ptr + row[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        else:
            kv = load_record_rows(cache_ptr, row, dims, kv_mask, head_dim, FMT).to(q.dtype)
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION) * qk_scale    # [BLOCK_H, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        if SPLIT:
            # A row that has seen neither key nor sink (a split after the first starts
            # without the sink) keeps max -inf; shift by 0 so it gets exp2(-inf) = 0, not
            # nan. With one split the sink seeds the max, which so stays finite.
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            shift = m_new
        alpha = tl.exp2(m - shift)
        p = tl.exp2(s - shift[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def _sparse_attention_kernel(
    q_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    cache0_ptr, slots0_ptr, cache1_ptr, slots1_ptr,
    k0, k1, num_heads, head_dim, tiles_per_split, qk_scale,
    stride_q_t, stride_q_h, stride_out_t, stride_out_h,
    stride_slots0_t, stride_slots0_k, stride_cache0_block, stride_cache0_offset,
    stride_slots1_t, stride_slots1_k, stride_cache1_block, stride_cache1_offset,
    BLOCK_SIZE0: tl.constexpr, BLOCK_SIZE1: tl.constexpr, TWO_SOURCES: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SCAN: tl.constexpr, ONE_SCAN: tl.constexpr, EVEN_H: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FMT0: tl.constexpr = 0, FMT1: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)                   # [BLOCK_H]
    split = tl.program_id(2)
    dims = tl.arange(0, BLOCK_D)
    # EVEN_H / EVEN_D (BLOCK_H divides H, BLOCK_D == D) drop the masks: fewer registers in
    # the key loop, which at D = 512 runs at the register limit.
    head_ok = heads < num_heads
    q_mask = head_ok[:, None] & (dims[None, :] < head_dim)
    q_ptrs = q_ptr + token * stride_q_t + heads[:, None] * stride_q_h + dims[None, :]
    if EVEN_H and EVEN_D:
        q = tl.load(q_ptrs)                                                      # [BLOCK_H, BLOCK_D]
        sink = tl.load(sinks_ptr + heads)
    else:
        q = tl.load(q_ptrs, mask=q_mask, other=0.0)
        sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0)
    sink = sink.to(tl.float32) * 1.4426950408889634
    m = tl.where(split == 0, sink, float("-inf"))                                # [BLOCK_H]
    l = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    # This split's tiles [tile_lo, tile_hi) of the sequence: source 0's ceil(k0 / BLOCK_N)
    # tiles, then source 1's. Without splits, each source's whole row.
    if SPLIT:
        tile_lo = split * tiles_per_split
        tile_hi = tile_lo + tiles_per_split
        lo0 = tl.minimum(tile_lo * BLOCK_N, k0)
        hi0 = tl.minimum(tile_hi * BLOCK_N, k0)
        tiles0 = tl.cdiv(k0, BLOCK_N)
        lo1 = tl.minimum(tl.maximum(tile_lo - tiles0, 0) * BLOCK_N, k1)
        hi1 = tl.minimum(tl.maximum(tile_hi - tiles0, 0) * BLOCK_N, k1)
    else:
        lo0, hi0, lo1, hi1 = 0, k0, 0, k1
    m, l, acc = _attend_source(q, m, l, acc, cache0_ptr, slots0_ptr, token, lo0, hi0,
                               dims, head_dim, qk_scale, stride_slots0_t, stride_slots0_k,
                               stride_cache0_block, stride_cache0_offset,
                               BLOCK_SIZE0, BLOCK_N, BLOCK_SCAN, ONE_SCAN, SPLIT, EVEN_D, DOT_PRECISION, FMT0)
    if TWO_SOURCES:
        m, l, acc = _attend_source(q, m, l, acc, cache1_ptr, slots1_ptr, token, lo1, hi1,
                                   dims, head_dim, qk_scale, stride_slots1_t, stride_slots1_k,
                                   stride_cache1_block, stride_cache1_offset,
                                   BLOCK_SIZE1, BLOCK_N, BLOCK_SCAN, ONE_SCAN, SPLIT, EVEN_D, DOT_PRECISION,
                                   FMT1)

    if SPLIT:
        # Partials [T, H, splits(, BLOCK_D)]; a split that saw nothing leaves max -inf, sum 0.
        part = (token * num_heads + heads) * tl.num_programs(2) + split          # [BLOCK_H]
        tl.store(part_max_ptr + part, m, mask=head_ok)
        tl.store(part_sum_ptr + part, l, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=head_ok[:, None])
    else:
        # l >= 1: the sink's own term.
        out = (acc / l[:, None]).to(out_ptr.dtype.element_ty)
        out_ptrs = out_ptr + token * stride_out_t + heads[:, None] * stride_out_h + dims[None, :]
        if EVEN_H and EVEN_D:
            tl.store(out_ptrs, out)
        else:
            tl.store(out_ptrs, out, mask=q_mask)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    num_heads, head_dim, num_splits, stride_out_t, stride_out_h,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    ok = splits < num_splits
    part = (token * num_heads + head) * num_splits + splits                      # [BLOCK_S]
    part_max = tl.load(part_max_ptr + part, mask=ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part, mask=ok, other=0.0)
    m = tl.max(part_max, axis=0)
    # A row no split saw anything for (max -inf, sums 0) gets 0 / 1 = 0, not nan.
    m = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(part_max - m)                                               # [BLOCK_S]
    denom = tl.sum(part_sum * weight, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / denom                          # [BLOCK_D]
    tl.store(out_ptr + token * stride_out_t + head * stride_out_h + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


def merge_splits(part_acc: torch.Tensor, part_max: torch.Tensor, part_sum: torch.Tensor,
                 out: torch.Tensor) -> None:
    """Merge split-K partial softmax results into ``out`` [T, H, D] (written in place).

    part_acc: [T, H, S, BLOCK_D] float32 unnormalised sums of p * v; part_max, part_sum:
    [T, H, S] float32 running max (base-2 logits) and sum of p of each split; a split
    that saw no key holds max -inf, sum 0, acc 0. Shared by the split-K attention kernels.
    """
    t, h, num_splits, block_d = part_acc.shape
    if out.shape[:2] != (t, h) or out.shape[2] > block_d or out.stride(2) != 1:
        raise ValueError(f"merge_splits: out {tuple(out.shape)} does not match partials "
                         f"{tuple(part_acc.shape)} or its last dim is not contiguous")
    _merge_splits_kernel[(t, h)](
        part_acc, part_max, part_sum, out, h, out.shape[2], num_splits, out.stride(0), out.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        **pdl.flags(part_acc.device))


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Tile config of one launch: BLOCK_H heads x BLOCK_N keys per tile, ``num_splits`` runs of
    key tiles per (token, head block), and the launch's warps and pipeline stages."""
    block_h: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


_LONG_PREFILL_T = 2048     # from here on prefill takes 64-key tiles (see default_config)
_MAX_SCAN = 1024           # most slots a program's trimming scan reads in one load (see _attend_source)
_QUERY_PROLOGUE = True     # rope_attention: the Gluon kernel normalises and ropes q itself
_DECODE_T = 64             # up to here 16-bit queries take the decode tiles (see default_config)


def default_config(q: torch.Tensor, num_tiles_at: Callable[[int], int]) -> SparseAttentionConfig:
    """The launcher's choice for q [T, H, D]; ``num_tiles_at(block_n)`` counts key tiles per token.

    BLOCK_H: all heads up to 64 (one key gather serves them all; 64 rows fill a Hopper
    warpgroup MMA), at least 16 (the smallest tensor-core tile); 16 for float32, whose exact
    (non-TF32) products run on CUDA cores with both operands in registers. BLOCK_N: the key
    tile stays within 32 KiB (32 bf16 keys at D = 512: with q's 64 KiB and two pipeline
    stages, 128 KiB of shared memory), 64 keys for long prefill chunks of 16-bit queries (on the
    H200 at T=4096, 128 window + 512 entries: 1,822 us vs 2,081 us with 32-key tiles;
    ``scripts/gpu_kernel_check.py sparse_attention``). Warps: 8 once the float32 accumulator [BLOCK_H, D]
    passes 64 KiB, so it needs at most 128 registers a thread. Splits: enough for about one
    program per SM, each with two key tiles at least; none off CUDA (the CPU interpreter
    gains nothing from them). Decode-sized 16-bit batches on CUDA (T <= 64) take their own
    tiles instead (below).
    """
    t, h, d = q.shape
    block_d = max(16, triton.next_power_of_2(d))
    block_h = min(64 if q.element_size() <= 2 else 16, max(16, triton.next_power_of_2(h)))
    block_n = max(16, min(64, 32 * 1024 // (block_d * q.element_size())))
    if q.is_cuda and t >= _LONG_PREFILL_T and q.element_size() == 2:
        block_n = 64
    if q.is_cuda and q.element_size() == 2 and t <= _DECODE_T:
        # Decode: few tokens, so few programs. 16-head programs over many short key runs
        # (up to ~4 waves, at most 32 splits) reach more SMs than 64-head ones; 16-key tiles
        # for a handful of tokens. H200, CUDA-graph replays, window 128 + top-512 at context
        # 1024: T=1 14.6 -> 8.1 us (window only 13.3 -> 6.0), T=16 20.5 -> 18.3 us; context
        # 8192, T=1: 16.1 -> 9.7 us (docs/BENCHMARKS.md).
        block_h, block_n, num_warps = 16, (16 if t <= 4 else 32), 4
        programs = t * triton.cdiv(h, block_h)
        num_splits = max(1, min(32, num_tiles_at(block_n),
                                triton.cdiv(4 * sm_count(q.device), programs)))
        return SparseAttentionConfig(block_h, block_n, num_splits, num_warps, num_stages=2)
    num_warps = 8 if block_h * block_d * 4 > 64 * 1024 else 4
    num_splits = 1
    if q.is_cuda:
        programs = t * triton.cdiv(h, block_h)
        tiles = num_tiles_at(block_n)
        num_splits = max(1, min(triton.cdiv(sm_count(q.device), programs), tiles // 2))
    return SparseAttentionConfig(block_h, block_n, num_splits, num_warps, num_stages=2)


def invariant_config(q: torch.Tensor) -> SparseAttentionConfig:
    """Batch-invariant mode's config for q [T, H, D]: from the head shape and dtype only, never
    from T or the key count (the decode tiles, the long-prefill key tiles and the Gluon
    kernel change a token's reduction order by batch), and no split, so each token's keys go
    in BLOCK_N tiles on its row's grid and one program sums them in order."""
    _, h, d = q.shape
    block_d = max(16, triton.next_power_of_2(d))
    block_h = min(64 if q.element_size() <= 2 else 16, max(16, triton.next_power_of_2(h)))
    block_n = max(16, min(64, 32 * 1024 // (block_d * q.element_size())))
    num_warps = 8 if block_h * block_d * 4 > 64 * 1024 else 4
    return SparseAttentionConfig(block_h, block_n, num_splits=1, num_warps=num_warps, num_stages=2)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 caches (tests, exactness) must not fall back to TF32 tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def _source_formats(sources: list[tuple[torch.Tensor, torch.Tensor]],
                    formats: list[str | None] | None) -> list[str | None]:
    if formats is None:
        return [None] * len(sources)
    if len(formats) != len(sources):
        raise ValueError(f"sparse_attention: formats has {len(formats)} entries for {len(sources)} sources")
    for fmt in formats:
        format_id(fmt)
    return list(formats)


def _check_inputs(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]],
                  sinks: torch.Tensor, formats: list[str | None]) -> None:
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"sparse_attention: q must be [T, H, D] with D contiguous, got shape "
                         f"{tuple(q.shape)} strides {q.stride()}")
    t, h, d = q.shape
    if not 1 <= len(sources) <= 2:
        raise ValueError(f"sparse_attention: takes 1 or 2 (cache, slots) sources, got {len(sources)}")
    for i, ((cache, slots), fmt) in enumerate(zip(sources, formats)):
        row, dtype = (d, q.dtype) if fmt is None else (record_bytes(fmt, d), torch.uint8)
        what = f"D={d}" if fmt is None else f"{fmt} record of D={d}: {row} bytes"
        if cache.dim() != 5 or cache.shape[3] != 1 or cache.shape[4] != row:
            raise ValueError(f"sparse_attention: sources[{i}] cache must be [NB, bs, nt, 1, {what}], "
                             f"got {tuple(cache.shape)}")
        if cache.stride(4) != 1:
            raise ValueError(f"sparse_attention: sources[{i}] cache's last dim must be contiguous, "
                             f"got strides {cache.stride()}")
        if cache.dtype != dtype or cache.device != q.device:
            raise ValueError(f"sparse_attention: sources[{i}] cache is {cache.dtype} on {cache.device}; it "
                             f"must be {dtype} on q's device {q.device}")
        if slots.dim() != 2 or slots.shape[0] != t or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"sparse_attention: sources[{i}] slots must be [T={t}, K] int32/int64, "
                             f"got {slots.dtype} of shape {tuple(slots.shape)}")
        if slots.device != q.device:
            raise ValueError(f"sparse_attention: sources[{i}] slots are on {slots.device}, q on {q.device}")
    if sinks.shape != (h,) or sinks.dtype != torch.float32:
        raise ValueError(f"sparse_attention: sinks must be [H={h}] float32, got {sinks.dtype} of "
                         f"shape {tuple(sinks.shape)}")


def _takes_gluon(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]],
                 formats: list[str | None] | None = None) -> bool:
    """Long 16-bit prefill chunks at 64 heads x 512 on Hopper go to the Gluon kernel
    (``sparse_attention_gluon.py``: the two warpgroups split the score tile; H200, T=4096,
    window 128 + top-512: 1,653 -> 982 us), unless DEEPINFER_GLUON_ATTENTION=0. Packed record
    sources stay here: the Gluon kernel copies bf16 rows into shared memory as they are and has
    no decode step (nor a CPU interpreter to test one in)."""
    if not (q.is_cuda and q.shape[0] >= _LONG_PREFILL_T and env.gluon_attention_enabled()):
        return False
    if formats is not None and any(fmt is not None for fmt in formats):
        return False
    from deepinfer.kernels import sparse_attention_gluon
    return sparse_attention_gluon.supported(q, sources)


def sparse_attention(
    q: torch.Tensor,                                   # [T, H, D]
    sources: list[tuple[torch.Tensor, torch.Tensor]],  # (cache [NB, bs, nt, 1, D], slots [T, K_i])
    sinks: torch.Tensor,                               # [H] float32 sink logits
    scale: float,
    config: SparseAttentionConfig | None = None,
    formats: list[str | None] | None = None,           # per source: None (values) or its record format
) -> torch.Tensor:                                     # [T, H, D]
    """Softmax attention of each token over the keys its slot rows name (see the module
    docstring); ``config`` overrides :func:`default_config`; a source with a record format in
    ``formats`` is a packed record cache (uint8 ``[NB, bs, nt, 1, record_bytes(fmt, D)]``). No
    host synchronisation: the launch depends only on shapes, so it can be captured in a CUDA graph."""
    formats = _source_formats(sources, formats)
    _check_inputs(q, sources, sinks, formats)
    t, h, d = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    live = [i for i, (_, slots) in enumerate(sources) if slots.shape[1] > 0]
    sources, formats = [sources[i] for i in live], [formats[i] for i in live]
    if not sources:
        return out.zero_()
    if config is None and _takes_gluon(q, sources, formats):
        from deepinfer.kernels.sparse_attention_gluon import sparse_attention_prefill
        return sparse_attention_prefill(q, sources, sinks, scale)
    lens = [slots.shape[1] for _, slots in sources]
    if config is None:
        config = default_config(q, lambda bn: sum(triton.cdiv(k, bn) for k in lens))
    block_d = max(16, triton.next_power_of_2(d))
    tiles = sum(triton.cdiv(k, config.block_n) for k in lens)
    tiles_per_split = triton.cdiv(tiles, config.num_splits)
    num_splits = triton.cdiv(tiles, tiles_per_split)       # no split left without a tile
    split = num_splits > 1
    if split:
        part_acc = torch.empty(t, h, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_max = torch.empty(t, h, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(t, h, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = sinks             # never touched
    (cache0, slots0), (cache1, slots1) = sources[0], sources[-1]
    # The most slots a program scans in a source: one load of them if that is at most
    # _MAX_SCAN. One width for both sources (H200, T=4096, window 128 + top-512: 1,643 us;
    # a 128-wide scan of the window, 512 of the top-k: 1,788 us).
    scan = min(max(lens), tiles_per_split * config.block_n)
    grid = (t, triton.cdiv(h, config.block_h), num_splits)
    _sparse_attention_kernel[grid](
        q, sinks, out, part_acc, part_max, part_sum,
        cache0, slots0, cache1, slots1,
        lens[0], lens[-1], h, d, tiles_per_split, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        slots0.stride(0), slots0.stride(1), cache0.stride(0), cache0.stride(1),
        slots1.stride(0), slots1.stride(1), cache1.stride(0), cache1.stride(1),
        BLOCK_SIZE0=cache0.shape[1], BLOCK_SIZE1=cache1.shape[1], TWO_SOURCES=len(sources) == 2,
        SPLIT=split, BLOCK_H=config.block_h, BLOCK_N=config.block_n, BLOCK_D=block_d,
        BLOCK_SCAN=triton.next_power_of_2(min(scan, _MAX_SCAN)), ONE_SCAN=scan <= _MAX_SCAN,
        EVEN_H=h % config.block_h == 0, EVEN_D=block_d == d,
        DOT_PRECISION=_dot_precision(q.dtype), FMT0=format_id(formats[0]), FMT1=format_id(formats[-1]),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.flags(q.device))
    if split:
        merge_splits(part_acc, part_max, part_sum, out)
    return out


def rope_attention(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, eps: float,
                   sources: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                   scale: float, config: SparseAttentionConfig | None = None,
                   formats: list[str | None] | None = None) -> torch.Tensor:
    """DeepSeek-V4's attention core from the raw query projection q [T, H, D] (see
    :func:`reference.rope_attention`): the q norm + rope, :func:`sparse_attention` (``formats``:
    per source, None or its record format), the inverse rope of the output. Where the Gluon
    kernel applies (plain sources only), it also does the first (two launches); otherwise three.
    ``config`` (e.g. :func:`invariant_config`) overrides the choice, the Gluon kernel's included."""
    from deepinfer.kernels.deepseek_v4_rope import interleaved_rope_, q_norm_rope
    half = inv_freq.shape[0] if inv_freq.dim() == 1 else 0
    live = [(cache, slots) for cache, slots in sources if slots.shape[1] > 0]
    plain = formats is None or all(fmt is None for fmt in formats)
    if (config is None and _QUERY_PROLOGUE and plain and live and half & (half - 1) == 0
            and 8 <= half <= q.shape[2] // 2
            and _takes_gluon(q, live)):
        from deepinfer.kernels.sparse_attention_gluon import QueryRope, sparse_attention_prefill
        _check_inputs(q, sources, sinks, [None] * len(sources))
        out = sparse_attention_prefill(q, live, sinks, scale, rope=QueryRope(positions, inv_freq, scaling, eps))
    else:
        out = sparse_attention(q_norm_rope(q, positions, inv_freq, scaling, eps), sources, sinks, scale, config,
                               formats=formats)
    return interleaved_rope_(out, positions, inv_freq, scaling, inverse=True)
