"""Paged attention over the KV cache, for GQA; references: :func:`reference.paged_decode_attention`
and :func:`reference.paged_attention`.

Cache layout (one layer): ``[num_blocks, block_size, 2, H_kv, D]``, a strided view
(several layers share a page), K at tensor 0 and V at tensor 1. Sequence b's
token at position p lives in block ``block_table[b, p // block_size]``.

Two kernels, both online-softmax (flash) over the sequence's keys in tiles of
``BLOCK_N`` positions, exponentials in base 2 with log2(e) folded into the scale:

* decode (one query per sequence): grid (B, H_kv, splits). A program holds the
  G = Hq/Hkv query heads that share one KV head as the rows of a tensor-core
  tile (padded to 16) and walks one split of the sequence's visible keys; a
  second kernel merges the splits' partial results and adds the sink. Splitting
  the keys keeps the GPU busy when B * H_kv is small next to the SM count. Its
  launcher reads the lengths on the device and sizes the grid from B and a
  bound ``max_seq_len``, so a decode step can be captured in a CUDA graph.
* prefill (any number of new queries per sequence, chunked, causal): grid
  (query tiles, H_kv). A tile is up to ``BLOCK_M // G`` consecutive new tokens
  of one sequence times its G heads; it walks the keys from the first query's
  window start to the last query and masks per row (causal, sliding window).
  The sink logit seeds the running max and sum, so it takes probability mass
  and contributes no value, as in the reference.

Batch-invariant mode (``batch_invariant.py``) runs every call through the prefill
kernel, decode included (:func:`paged_decode_attention_invariant`, one token a tile,
its tile table built on the device), with the window's first key tile aligned to a
multiple of ``BLOCK_N``: a query's keys then go in tiles at absolute positions whatever
tile or step it comes in, and the tiles before its window or past its position are
fully masked, which leaves the running (max, sum, acc) exactly as they were. Its rows
in a tile are computed independently by the MMA, so its bits do not depend on the
tokens that share its tile, its chunk or its batch.

Scores and softmax run in float32; P is rounded to the cache dtype before the
P @ V product (the flash-attention convention; exact for float32 caches).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

from deepinfer.transfer import to_device

_LOG2E = math.log2(math.e)


@triton.jit
def _load_kv_rows(cache_ptr, block_table_ptr, seq, pos, valid, kv_head, dims, head_dim, tensor,
                  stride_bt_seq, stride_cache_block, stride_cache_offset, stride_cache_tensor,
                  stride_cache_head, BLOCK_SIZE: tl.constexpr):
    """Rows ``pos`` ([BLOCK_N]) of tensor ``tensor`` (0 = K, 1 = V) for one KV head: [BLOCK_N, BLOCK_D]."""
    block = tl.load(block_table_ptr + seq * stride_bt_seq + pos // BLOCK_SIZE, mask=valid, other=0)
    row = (block.to(tl.int64) * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_offset
           + tensor * stride_cache_tensor + kv_head * stride_cache_head)
    mask = valid[:, None] & (dims[None, :] < head_dim)
    return tl.load(cache_ptr + row[:, None] + dims[None, :], mask=mask, other=0.0)


@triton.jit
def _decode_split_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    qk_scale, window,
    stride_q_seq, stride_q_head, stride_bt_seq,
    stride_cache_block, stride_cache_offset, stride_cache_tensor, stride_cache_head,
    head_dim,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(seq_len - window, 0)
    # Each split takes an equal, BLOCK_N-aligned share of this sequence's visible keys.
    per_split = tl.cdiv(tl.cdiv(seq_len - start, num_splits), BLOCK_N) * BLOCK_N
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * G + g                                                      # [BLOCK_G]
    q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                mask=(g[:, None] < G) & (dims[None, :] < head_dim), other=0.0)   # [BLOCK_G, BLOCK_D]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < hi
        k = _load_kv_rows(cache_ptr, block_table_ptr, seq, pos, valid, kv_head, dims, head_dim, 0,
                          stride_bt_seq, stride_cache_block, stride_cache_offset, stride_cache_tensor,
                          stride_cache_head, BLOCK_SIZE)                         # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every tile holds at least one valid key, so m_new is finite.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = _load_kv_rows(cache_ptr, block_table_ptr, seq, pos, valid, kv_head, dims, head_dim, 1,
                          stride_bt_seq, stride_cache_block, stride_cache_offset, stride_cache_tensor,
                          stride_cache_head, BLOCK_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    # Partial results, [B, Hq, splits(, D)]; an empty split leaves max -inf and sum 0.
    part = (seq * (tl.num_programs(1) * G) + heads) * num_splits + split         # [BLOCK_G]
    row_ok = g < G
    tl.store(part_max_ptr + part, m, mask=row_ok)
    tl.store(part_sum_ptr + part, l, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, sinks_ptr, out_ptr,
    stride_out_seq, stride_out_head, head_dim, num_splits,
    HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    part = (seq * tl.num_programs(1) + head) * num_splits + splits             # [BLOCK_S]
    ok = splits < num_splits
    part_max = tl.load(part_max_ptr + part, mask=ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part, mask=ok, other=0.0)
    m = tl.max(part_max, axis=0)                       # finite: split 0 always holds keys
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
        m = tl.maximum(m, sink)
    weight = tl.exp2(part_max - m)                                               # [BLOCK_S]
    denom = tl.sum(part_sum * weight, axis=0)
    if HAS_SINKS:
        denom += tl.exp2(sink - m)
    acc = tl.load(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / denom                          # [BLOCK_D]
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, block_table_ptr, tiles_ptr, sinks_ptr, out_ptr,
    qk_scale, window,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head, stride_bt_seq,
    stride_cache_block, stride_cache_offset, stride_cache_tensor, stride_cache_head,
    head_dim,
    G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ALIGN_WINDOW: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # tiles: [num_tiles, 4] = (sequence, first query row, query count, first query position)
    seq = tl.load(tiles_ptr + tile * 4).to(tl.int64)
    row0 = tl.load(tiles_ptr + tile * 4 + 1).to(tl.int64)
    count = tl.load(tiles_ptr + tile * 4 + 2)
    pos0 = tl.load(tiles_ptr + tile * 4 + 3)

    r = tl.arange(0, BLOCK_M)
    tok = r // G                                     # row r is query token r // G, head r % G
    heads = kv_head * G + r % G
    row_ok = tok < count
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + (row0 + tok)[:, None] * stride_q_token + heads[:, None] * stride_q_head
                + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < head_dim), other=0.0)
    q_pos = pos0 + tok                                                           # [BLOCK_M]
    if HAS_SINKS:
        # The sink seeds the running softmax: max = sink, sum = exp2(sink - max) = 1.
        m = tl.load(sinks_ptr + heads).to(tl.float32) * 1.4426950408889634      # log2(e)
        l = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(pos0 - window + 1, 0)
        if ALIGN_WINDOW:
            # Key tiles at absolute positions (batch-invariant mode; see the module docstring).
            kv_lo = kv_lo // BLOCK_N * BLOCK_N
    kv_hi = pos0 + count
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = n0 + tl.arange(0, BLOCK_N)
        valid = k_pos < kv_hi
        k = _load_kv_rows(cache_ptr, block_table_ptr, seq, k_pos, valid, kv_head, dims, head_dim, 0,
                          stride_bt_seq, stride_cache_block, stride_cache_offset, stride_cache_tensor,
                          stride_cache_head, BLOCK_SIZE)                         # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # [BLOCK_M, BLOCK_N]
        allowed = valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & ((q_pos[:, None] - k_pos[None, :]) < window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen no key yet keeps max -inf; shift by 0 so it gets
        # exp2(-inf) = 0 instead of exp2(-inf - -inf) = nan.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)
        p = tl.exp2(s - shift[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = _load_kv_rows(cache_ptr, block_table_ptr, seq, k_pos, valid, kv_head, dims, head_dim, 1,
                          stride_bt_seq, stride_cache_block, stride_cache_offset, stride_cache_tensor,
                          stride_cache_head, BLOCK_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    # Padding rows may have seen no key (l = 0); they are not stored.
    out = acc / tl.where(row_ok, l, 1.0)[:, None]
    tl.store(out_ptr + (row0 + tok)[:, None] * stride_out_token + heads[:, None] * stride_out_head
             + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dims[None, :] < head_dim))


def _check_inputs(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                  sinks: torch.Tensor | None) -> tuple[int, int]:
    """Shape/stride checks shared by both launchers; returns (G, block_size)."""
    if q.dim() != 3 or cache.dim() != 5:
        raise ValueError(f"paged attention: q must be [T, Hq, D] and cache [NB, bs, 2, Hkv, D], got "
                         f"{tuple(q.shape)} and {tuple(cache.shape)}")
    _, bs, nt, hkv, d = cache.shape
    hq = q.shape[1]
    if nt != 2 or q.shape[2] != d or hq % hkv:
        raise ValueError(f"paged attention: cache {tuple(cache.shape)} must hold 2 tensors of head "
                         f"dim {q.shape[2]} with H_kv dividing Hq={hq}")
    if q.dtype != cache.dtype:
        raise ValueError(f"paged attention: q is {q.dtype} but the cache is {cache.dtype}")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("paged attention: q's and the cache's last dim (D) must be contiguous")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"paged attention: block_table must be [B, M] int32/int64, got "
                         f"{block_table.dtype} of shape {tuple(block_table.shape)}")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"paged attention: sinks must be [Hq={hq}], got {tuple(sinks.shape)}")
    return hq // hkv, bs


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 caches (tests, exactness) must not fall back to TF32 tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def _decode_num_splits(q: torch.Tensor, num_kv_heads: int, max_span: int, block_n: int) -> int:
    """Enough (sequence, KV head, split) programs for about four per SM, each with at
    least four key tiles of work, and at most 64 splits."""
    if q.device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    want = triton.cdiv(4 * sms, q.shape[0] * num_kv_heads)
    return max(1, min(want, triton.cdiv(max_span, 4 * block_n), 64))


def paged_decode_attention(
    q: torch.Tensor,               # [B, Hq, D] one query per sequence, at position seq_lens[b] - 1
    cache: torch.Tensor,           # [NB, bs, 2, Hkv, D]
    block_table: torch.Tensor,     # [B, M]
    seq_lens: torch.Tensor,        # [B] int32 on q's device, each in [1, max_seq_len]
    max_seq_len: int,              # bound on every seq_lens[b]: sizes the key splits
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    num_splits: int | None = None,
) -> torch.Tensor:                 # [B, Hq, D]
    """Split-KV decode attention; ``num_splits`` overrides the launcher's choice.

    CUDA-graph safe: the lengths are read on the device and the grid and buffers are
    sized from B and ``max_seq_len`` only, with no host synchronisation, so a graph
    captured with ``max_seq_len = max_model_len`` serves any lengths up to it (splits
    past a short sequence's keys are empty and merge as nothing). A row of length 1
    over a null-block table row (CUDA-graph padding) reads one finite entry."""
    g, bs = _check_inputs(q, cache, block_table, sinks)
    b, hq, d = q.shape
    hkv = cache.shape[3]
    if block_table.shape[0] != b:
        raise ValueError(f"paged decode: q has {b} sequences, block_table {block_table.shape[0]}")
    if (seq_lens.shape != (b,) or seq_lens.dtype != torch.int32 or seq_lens.device != q.device
            or seq_lens.stride(0) != 1):
        raise ValueError(f"paged decode: seq_lens must be a contiguous [B={b}] int32 tensor on "
                         f"{q.device}, got {seq_lens.dtype} of shape {tuple(seq_lens.shape)} on "
                         f"{seq_lens.device}")
    if max_seq_len < 1:
        raise ValueError(f"paged decode: max_seq_len={max_seq_len} must be >= 1")
    out = torch.empty_like(q)
    if b == 0:
        return out
    # Tile config: BLOCK_N = 64 key positions per step (several pages when bs < 64);
    # the G heads sharing a KV head padded to a 16-row tensor-core tile.
    block_n, block_d = 64, max(16, triton.next_power_of_2(d))
    max_span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    if num_splits is None:
        num_splits = _decode_num_splits(q, hkv, max_span, block_n)
    part_acc = torch.empty(b, hq, num_splits, block_d, dtype=torch.float32, device=q.device)
    part_max = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(b, hkv, num_splits)](
        q, cache, block_table, seq_lens, part_acc, part_max, part_sum,
        scale * _LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), block_table.stride(0),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        d,
        G=g, BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_SIZE=bs, HAS_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=4, num_stages=2, **pdl.flags(q.device))
    _decode_reduce_kernel[(b, hq)](
        part_acc, part_max, part_sum, sinks if sinks is not None else part_max, out,
        out.stride(0), out.stride(1), d, num_splits,
        HAS_SINKS=sinks is not None, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        num_warps=4, **pdl.flags(part_acc.device))
    return out


def paged_attention(
    q: torch.Tensor,               # [T, Hq, D]
    cache: torch.Tensor,           # [NB, bs, 2, Hkv, D]
    block_table: torch.Tensor,     # [B, M]
    query_start_loc: list[int],    # [B+1]
    seq_lens: list[int],           # [B]
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
    invariant: bool = False,
) -> torch.Tensor:                 # [T, Hq, D]
    """Attention of each sequence's new queries over its paged cache (their K/V already
    stored); sequence b's queries sit at positions ``seq_lens[b] - q_len .. seq_lens[b] - 1``.
    An all-decode batch takes the split-KV decode kernel, any other the prefill kernel;
    ``invariant`` (batch-invariant mode): every batch the prefill kernel, key tiles at
    absolute positions (see the module docstring)."""
    g, bs = _check_inputs(q, cache, block_table, sinks)
    t, _, d = q.shape
    num_seqs = len(seq_lens)
    if len(query_start_loc) != num_seqs + 1 or query_start_loc[-1] != t:
        raise ValueError(f"paged attention: query_start_loc={query_start_loc} must have "
                         f"{num_seqs + 1} entries ending at T={t}")
    q_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(num_seqs)]
    if any(n > L for n, L in zip(q_lens, seq_lens)):
        raise ValueError(f"paged attention: a sequence has more new tokens than context "
                         f"(q_lens={q_lens}, seq_lens={seq_lens})")
    if num_seqs and all(n == 1 for n in q_lens) and not invariant:
        if block_table.shape[0] != num_seqs:
            raise ValueError(f"paged attention: {num_seqs} sequences but block_table has "
                             f"{block_table.shape[0]} rows")
        lens = to_device(seq_lens, torch.int32, q.device)
        return paged_decode_attention(q, cache, block_table, lens, max(seq_lens), scale,
                                      sliding_window, sinks)
    out = torch.empty_like(q)
    block_m, _, _ = _prefill_tiles(g, d)
    tokens_per_tile = block_m // g
    tiles = [(b, query_start_loc[b] + i, min(tokens_per_tile, n - i), seq_lens[b] - n + i)
             for b, n in enumerate(q_lens) for i in range(0, n, tokens_per_tile)]
    if not tiles:
        return out
    tile_table = to_device(tiles, torch.int32, q.device)                     # [num_tiles, 4]
    _launch_prefill(q, cache, block_table, tile_table, out, scale, sliding_window, sinks, invariant)
    return out


def _prefill_tiles(g: int, d: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) of the prefill kernel: 64 query rows (BLOCK_M // G tokens x
    G heads) by 64 key positions; at head dim 256 the key tile halves to stay within shared
    memory. From the head shape only, never from the batch."""
    block_d = max(16, triton.next_power_of_2(d))
    return max(64, triton.next_power_of_2(g)), (64 if block_d <= 128 else 32), block_d


def _launch_prefill(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, tile_table: torch.Tensor,
                    out: torch.Tensor, scale: float, sliding_window: int | None, sinks: torch.Tensor | None,
                    align_window: bool) -> None:
    g, bs = q.shape[1] // cache.shape[3], cache.shape[1]
    block_m, block_n, block_d = _prefill_tiles(g, q.shape[2])
    _prefill_kernel[(tile_table.shape[0], cache.shape[3])](
        q, cache, block_table, tile_table, sinks if sinks is not None else q, out,
        scale * _LOG2E, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
        q.shape[2],
        G=g, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_SIZE=bs,
        HAS_WINDOW=sliding_window is not None, HAS_SINKS=sinks is not None,
        DOT_PRECISION=_dot_precision(q.dtype), ALIGN_WINDOW=align_window, num_warps=4, num_stages=2,
        **pdl.flags(q.device))


def paged_decode_attention_invariant(
    q: torch.Tensor,               # [B, Hq, D] one query per sequence, at position seq_lens[b] - 1
    cache: torch.Tensor,           # [NB, bs, 2, Hkv, D]
    block_table: torch.Tensor,     # [B, M]
    seq_lens: torch.Tensor,        # [B] int32 on q's device, each >= 1
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq]
) -> torch.Tensor:                 # [B, Hq, D]
    """Decode attention in batch-invariant mode: the prefill kernel with one token a tile
    and key tiles at absolute positions, so a decode query sums its keys exactly as it would
    inside a prefill chunk. The tile table is built on the device from ``seq_lens``: no
    host synchronisation, CUDA-graph safe."""
    _check_inputs(q, cache, block_table, sinks)
    b = q.shape[0]
    if block_table.shape[0] != b or seq_lens.shape != (b,) or seq_lens.device != q.device:
        raise ValueError(f"paged decode: q has {b} sequences; block_table has {block_table.shape[0]} rows "
                         f"and seq_lens shape {tuple(seq_lens.shape)} on {seq_lens.device}")
    out = torch.empty_like(q)
    if b == 0:
        return out
    rows = torch.arange(b, dtype=torch.int32, device=q.device)
    tile_table = torch.stack([rows, rows, torch.ones_like(rows), seq_lens.to(torch.int32) - 1], dim=1)
    _launch_prefill(q, cache, block_table, tile_table, out, scale, sliding_window, sinks, True)
    return out
