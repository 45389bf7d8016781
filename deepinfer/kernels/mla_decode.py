"""Paged MLA decode (DeepSeek-V2/V3) in the absorbed form; reference: :func:`reference.mla_decode`.

The cache holds one latent entry ``[c (R), k_pe (Dr)]`` per token (``[NB, bs, 1, 1, R + Dr]``,
a strided view into pages shared by many layers). The caller absorbs kv_b_proj's key half
into the query (``q = [W_uk^T q_nope, q_pe]``, [B, Nh, R + Dr]) and applies its value half
to the result, so attention runs directly over the entries: one KV vector shared by all
Nh heads (MQA), keys all R + Dr dims, values the first R.

Grid (B, ceil(Nh / BLOCK_H), splits). A program holds BLOCK_H heads of one sequence as the
rows of a tensor-core tile and walks one split of the sequence's positions in tiles of
BLOCK_N through its block table: each gathered entry tile serves all BLOCK_H heads for
S = q_c c^T + q_pe k_pe^T and for P @ c, with an online softmax in float32 (base 2, log2(e)
folded into the scale). Splits keep the GPU busy when B * Nh / BLOCK_H is small next to the
SM count; their partials are merged by :func:`sparse_attention.merge_splits`. The split
count comes from ``max_seq_len`` (a bound, not the batch's lengths), so the launch never
reads the device and can be captured in a CUDA graph; rows of length 0 (graph padding)
give zeros.

P is rounded to the cache dtype before P @ c (the flash-attention convention; exact for
float32 caches).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

from deepinfer.kernels.launch import sm_count
from deepinfer.kernels.sparse_attention import merge_splits

_LOG2E = math.log2(math.e)


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    qk_scale, num_heads, kv_lora_rank, rope_dim,
    stride_q_b, stride_q_h, stride_out_b, stride_out_h, stride_bt_b,
    stride_cache_block, stride_cache_offset,
    BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)                   # [BLOCK_H]
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    head_ok = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each split takes an equal, BLOCK_N-aligned share of the sequence's positions.
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    r = tl.arange(0, BLOCK_R)
    e = tl.arange(0, BLOCK_DR)
    q_row = q_ptr + seq * stride_q_b + heads[:, None] * stride_q_h
    q_c = tl.load(q_row + r[None, :], mask=head_ok[:, None] & (r[None, :] < kv_lora_rank),
                  other=0.0)                                                     # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(q_row + kv_lora_rank + e[None, :], mask=head_ok[:, None] & (e[None, :] < rope_dim),
                   other=0.0)                                                    # [BLOCK_H, BLOCK_DR]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)                                         # [BLOCK_N]
        valid = pos < hi
        block = tl.load(block_table_ptr + seq * stride_bt_b + pos // BLOCK_SIZE, mask=valid, other=0)
        row = block.to(tl.int64) * stride_cache_block + (pos % BLOCK_SIZE) * stride_cache_offset
        c = tl.load(cache_ptr + row[:, None] + r[None, :],
                    mask=valid[:, None] & (r[None, :] < kv_lora_rank), other=0.0)   # [BLOCK_N, BLOCK_R]
        k_pe = tl.load(cache_ptr + row[:, None] + kv_lora_rank + e[None, :],
                       mask=valid[:, None] & (e[None, :] < rope_dim), other=0.0)  # [BLOCK_N, BLOCK_DR]
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))                           # [BLOCK_H, BLOCK_N]
        # Every tile holds a valid position, so m_new is finite.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m = m_new

    if SPLIT:
        # Partials [B, Nh, splits(, BLOCK_R)]; an empty split leaves max -inf, sum 0.
        part = (seq * num_heads + heads) * num_splits + split                    # [BLOCK_H]
        tl.store(part_max_ptr + part, m, mask=head_ok)
        tl.store(part_sum_ptr + part, l, mask=head_ok)
        tl.store(part_acc_ptr + part[:, None] * BLOCK_R + r[None, :], acc, mask=head_ok[:, None])
    else:
        # A padding row (length 0) has l = 0 and acc = 0: it gets zeros.
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(out_ptr + seq * stride_out_b + heads[:, None] * stride_out_h + r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (r[None, :] < kv_lora_rank))


@dataclass(frozen=True)
class MLADecodeConfig:
    """Tile config of one launch: BLOCK_H heads x BLOCK_N positions per tile, ``num_splits``
    runs of positions per (sequence, head block), and the launch's warps and pipeline stages."""
    block_h: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


def default_config(q: torch.Tensor, kv_lora_rank: int, max_seq_len: int) -> MLADecodeConfig:
    """The launcher's choice for q [B, Nh, R + Dr] over contexts of up to ``max_seq_len``.

    BLOCK_H: up to 64 heads (a Hopper warpgroup MMA's rows; one entry gather serves them
    all), at least 16 (the smallest tensor-core tile); 16 for float32, whose exact products
    run on CUDA cores. BLOCK_N: the latent tile within 32 KiB (32 bf16 entries at R = 512).
    Warps: 8 once the float32 accumulator [BLOCK_H, R] passes 64 KiB. Splits: about one
    program per SM, each with four position tiles at least, at most 64; none off CUDA.
    """
    config = invariant_config(q, kv_lora_rank)
    b, nh, _ = q.shape
    if not q.is_cuda or b == 0:
        return config
    programs = b * triton.cdiv(nh, config.block_h)
    num_splits = max(1, min(triton.cdiv(sm_count(q.device), programs),
                            triton.cdiv(max_seq_len, 4 * config.block_n), 64))
    return dataclasses.replace(config, num_splits=num_splits)


def invariant_config(q: torch.Tensor, kv_lora_rank: int) -> MLADecodeConfig:
    """:func:`default_config`'s tiles, warps and stages (chosen from Nh, R and the dtype) without
    a split: each row walks its positions from 0 in BLOCK_N tiles in one online softmax, the same
    reduction whatever the batch, its lengths or ``max_seq_len`` (batch-invariant mode's config)."""
    nh = q.shape[1]
    block_r = max(16, triton.next_power_of_2(kv_lora_rank))
    block_h = min(64 if q.element_size() <= 2 else 16, max(16, triton.next_power_of_2(nh)))
    block_n = max(16, min(64, 32 * 1024 // (block_r * q.element_size())))
    num_warps = 8 if block_h * block_r * 4 > 64 * 1024 else 4
    return MLADecodeConfig(block_h, block_n, 1, num_warps, num_stages=2)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 caches (tests, exactness) must not fall back to TF32 tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def mla_decode(
    q: torch.Tensor,               # [B, Nh, R + Dr] absorbed queries
    cache: torch.Tensor,           # [NB, bs, 1, 1, R + Dr] latent entries
    block_table: torch.Tensor,     # [B, M] int32/int64
    seq_lens: torch.Tensor,        # [B] int32/int64 on q's device, each <= max_seq_len
    scale: float,
    kv_lora_rank: int,             # R
    max_seq_len: int,              # a bound on seq_lens (ForwardContext.max_seq_len)
    config: MLADecodeConfig | None = None,
) -> torch.Tensor:                 # [B, Nh, R]
    """Absorbed MLA decode attention (see the module docstring); ``config`` overrides
    :func:`default_config`."""
    if q.dim() != 3 or q.stride(2) != 1:
        raise ValueError(f"mla_decode: q must be [B, Nh, R + Dr] with the last dim contiguous, got "
                         f"shape {tuple(q.shape)} strides {q.stride()}")
    b, nh, width = q.shape
    rope_dim = width - kv_lora_rank
    if rope_dim < 0:
        raise ValueError(f"mla_decode: q's last dim {width} is below kv_lora_rank={kv_lora_rank}")
    if cache.dim() != 5 or cache.shape[2:] != (1, 1, width) or cache.stride(4) != 1:
        raise ValueError(f"mla_decode: cache must be [NB, bs, 1, 1, {width}] with the last dim "
                         f"contiguous, got shape {tuple(cache.shape)} strides {cache.stride()}")
    if cache.dtype != q.dtype or cache.device != q.device:
        raise ValueError(f"mla_decode: cache is {cache.dtype} on {cache.device} but q is {q.dtype} "
                         f"on {q.device}")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.stride(1) != 1 \
            or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"mla_decode: block_table must be [B={b}, M] int32/int64 with contiguous rows, "
                         f"got {block_table.dtype} of shape {tuple(block_table.shape)}")
    if seq_lens.shape != (b,) or seq_lens.dtype not in (torch.int32, torch.int64) \
            or seq_lens.device != q.device:
        raise ValueError(f"mla_decode: seq_lens must be a [B={b}] int32/int64 tensor on {q.device}, "
                         f"got {seq_lens.dtype} of shape {tuple(seq_lens.shape)} on {seq_lens.device}")
    out = torch.empty(b, nh, kv_lora_rank, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if config is None:
        config = default_config(q, kv_lora_rank, max_seq_len)
    block_r = max(16, triton.next_power_of_2(kv_lora_rank))
    split = config.num_splits > 1
    if split:
        part_acc = torch.empty(b, nh, config.num_splits, block_r, dtype=torch.float32, device=q.device)
        part_max = torch.empty(b, nh, config.num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(b, nh, config.num_splits, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_max = part_sum = out               # never touched
    _mla_decode_kernel[(b, triton.cdiv(nh, config.block_h), config.num_splits)](
        q, cache, block_table, seq_lens, out, part_acc, part_max, part_sum,
        scale * _LOG2E, nh, kv_lora_rank, rope_dim,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        cache.stride(0), cache.stride(1),
        BLOCK_SIZE=cache.shape[1], SPLIT=split, BLOCK_H=config.block_h, BLOCK_N=config.block_n,
        BLOCK_R=block_r, BLOCK_DR=max(16, triton.next_power_of_2(rope_dim)),
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl.flags(q.device))
    if split:
        merge_splits(part_acc, part_max, part_sum, out)
    return out
