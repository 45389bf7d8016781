"""DeepSeek-V4 interleaved partial RoPE fused with the q / kv RMS norms; references:
:func:`reference.q_norm_rope`, :func:`reference.kv_norm_rope`, :func:`reference.interleaved_rope`.

Decode at batch 1 is launch bound, and the torch path spends a dozen small ops
per rope (cos/sin tables, repeat_interleave, stack, cat) plus a few per norm.
Here one launch does a whole step: program (t, head block) loads token t's
position, computes cos/sin of ``position * inv_freq`` in-kernel, optionally
RMS-normalises each head row, and rotates the trailing R channels in adjacent
pairs (2i, 2i+1), which it loads as two strided halves (even, odd channels).
The kv variant can also store its result into a paged cache in the same launch.

Numerics follow the references: the norm's sum of squares and factor in
float32; the unweighted (q) norm multiplies in x's dtype, the weighted (kv)
norm in float32 and rounds once; the rotation runs in float32 on the rounded
normed values. The angle is the float32 product ``position * inv_freq`` as in
the reference; it is reduced to [-pi, pi] in float64 before tl.cos / tl.sin,
so accuracy does not depend on how the backend's trig handles large arguments
(positions reach ~1e6 radians).

Nothing here reads device data on the host: safe inside a CUDA graph.
Shapes: T tokens, H heads, D head dim, R rotary dims (R/2 = inv_freq's length).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

# The norm variants (the kernel's NORM constexpr).
NO_NORM, UNWEIGHTED, WEIGHTED = 0, 1, 2


@triton.jit
def _normalise(x, w, rstd, dtype, NORM: tl.constexpr):
    """x: float32 values of the input; -> float32 values of the normed row, rounded to ``dtype``."""
    if NORM == 1:
        y = x * rstd.to(dtype).to(tl.float32)          # the q norm: the product in x's dtype
    else:
        y = w * (x * rstd)                             # V4 RMSNorm: weight * x_normed in float32
    return y.to(dtype).to(tl.float32)


@triton.jit
def _norm_rope_kernel(
    x_ptr, out_ptr, w_ptr, pos_ptr, inv_freq_ptr, cache_ptr, slot_ptr,
    stride_x_token, stride_x_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_offset,
    num_heads, head_dim, cache_block_size, scaling, sin_sign, eps,
    HALF: tl.constexpr, NORM: tl.constexpr, HAS_CACHE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]       # [BLOCK_H, 1]
    head_ok = heads < num_heads
    nope = head_dim - 2 * HALF
    src = x_ptr + token * stride_x_token + heads * stride_x_head
    dst = out_ptr + token * stride_out_token + heads * stride_out_head
    dtype = x_ptr.dtype.element_ty

    # Angles: float32 as the reference, then reduced to [-pi, pi] exactly enough in float64.
    pairs = tl.arange(0, BLOCK_HALF)[None, :]                                   # [1, BLOCK_HALF]
    pair_ok = pairs < HALF
    pos = tl.load(pos_ptr + token).to(tl.float32)
    freq = pos * tl.load(inv_freq_ptr + pairs, mask=pair_ok, other=0.0)         # [1, BLOCK_HALF]
    two_pi = tl.full([], 6.283185307179586, tl.float64)
    f64 = freq.to(tl.float64)
    turns = tl.floor(f64 / two_pi + 0.5)
    angle = (f64 - turns * two_pi).to(tl.float32)
    cos = tl.cos(angle) * scaling
    sin = tl.sin(angle) * scaling * sin_sign

    # The token's cache row (one kv head: tensor 0, head 0); a slot of -1 stores nothing.
    slot = tl.full([], -1, tl.int64)
    if HAS_CACHE:
        slot = tl.load(slot_ptr + token).to(tl.int64)
    row = (cache_ptr + (slot // cache_block_size) * stride_cache_block
           + (slot % cache_block_size) * stride_cache_offset)               # used only when slot >= 0

    rstd = tl.zeros([BLOCK_H, 1], dtype=tl.float32)
    w_even = tl.zeros([1, BLOCK_HALF], dtype=tl.float32)
    w_odd = tl.zeros([1, BLOCK_HALF], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_D)[None, :]                                       # [1, BLOCK_D]
    if NORM != 0:
        # The whole row for the sum of squares; its nope channels are finished here.
        row_mask = head_ok & (cols < head_dim)
        x = tl.load(src + cols, mask=row_mask, other=0.0).to(tl.float32)       # [BLOCK_H, BLOCK_D]
        rstd = tl.rsqrt(tl.sum(x * x, axis=1)[:, None] / head_dim + eps)       # [BLOCK_H, 1]
        w = tl.zeros([1, BLOCK_D], dtype=tl.float32)
        if NORM == 2:
            w = tl.load(w_ptr + cols, mask=cols < head_dim, other=0.0)
            w_even = tl.load(w_ptr + nope + 2 * pairs, mask=pair_ok, other=0.0)
            w_odd = tl.load(w_ptr + nope + 2 * pairs + 1, mask=pair_ok, other=0.0)
        y = _normalise(x, w, rstd, dtype, NORM)
        tl.store(dst + cols, y.to(out_ptr.dtype.element_ty), mask=head_ok & (cols < nope))
        if HAS_CACHE:
            if slot >= 0:
                tl.store(row + cols, y.to(dtype).to(cache_ptr.dtype.element_ty), mask=head_ok & (cols < nope))

    pair_mask = head_ok & pair_ok
    even = tl.load(src + nope + 2 * pairs, mask=pair_mask, other=0.0).to(tl.float32)
    odd = tl.load(src + nope + 2 * pairs + 1, mask=pair_mask, other=0.0).to(tl.float32)
    if NORM != 0:
        even = _normalise(even, w_even, rstd, dtype, NORM)
        odd = _normalise(odd, w_odd, rstd, dtype, NORM)
    out_even = (even * cos - odd * sin).to(dtype)
    out_odd = (odd * cos + even * sin).to(dtype)
    tl.store(dst + nope + 2 * pairs, out_even.to(out_ptr.dtype.element_ty), mask=pair_mask)
    tl.store(dst + nope + 2 * pairs + 1, out_odd.to(out_ptr.dtype.element_ty), mask=pair_mask)
    if HAS_CACHE:
        if slot >= 0:
            tl.store(row + nope + 2 * pairs, out_even.to(cache_ptr.dtype.element_ty), mask=pair_mask)
            tl.store(row + nope + 2 * pairs + 1, out_odd.to(cache_ptr.dtype.element_ty), mask=pair_mask)


@triton.jit
def _rope_kernel(
    x_ptr, pos_ptr, inv_freq_ptr, T, stride_x_token, stride_x_head, num_heads, rope_start,
    scaling, sin_sign,
    HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False,
):
    """In place, the rope only (no norm): program (token block, head block) loads each token's
    trailing ``2 * HALF`` channels of ``BLOCK_H`` heads as one contiguous [BLOCK_H, 2 * HALF]
    tile and splits it into (even, odd) in registers, where ``_norm_rope_kernel`` loads the
    two halves with stride-2 gathers. The angles are computed once per token, not per head
    block as there."""
    pdl.enter(PDL)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]          # [BH, 1]
    chans = tl.arange(0, 2 * HALF)[None, :]                                     # [1, R]
    mask = heads < num_heads
    pairs = tl.arange(0, HALF)
    inv_freq = tl.load(inv_freq_ptr + pairs)                                    # [HALF]
    two_pi = tl.full([], 6.283185307179586, tl.float64)
    for i in range(BLOCK_T):
        token = tl.program_id(0) * BLOCK_T + i
        if token < T:
            # Angles as in _norm_rope_kernel: the float32 product, reduced in float64.
            f64 = (tl.load(pos_ptr + token).to(tl.float32) * inv_freq).to(tl.float64)
            angle = (f64 - tl.floor(f64 / two_pi + 0.5) * two_pi).to(tl.float32)
            cos = (tl.cos(angle) * scaling)[None, :]                            # [1, HALF]
            sin = (tl.sin(angle) * scaling * sin_sign)[None, :]
            ptrs = x_ptr + token.to(tl.int64) * stride_x_token + heads * stride_x_head + rope_start + chans
            x = tl.load(ptrs, mask=mask, other=0.0)                             # [BH, R]
            even, odd = tl.split(tl.reshape(x.to(tl.float32), [BLOCK_H, HALF, 2]))
            out_even = (even * cos - odd * sin).to(x.dtype)
            out_odd = (odd * cos + even * sin).to(x.dtype)
            tl.store(ptrs, tl.reshape(tl.join(out_even, out_odd), [BLOCK_H, 2 * HALF]), mask=mask)


def _check(x: torch.Tensor, out: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
           weight: torch.Tensor | None, cache: torch.Tensor | None, slot_mapping: torch.Tensor | None,
           name: str) -> None:
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be [T, H, D], got shape {tuple(x.shape)}")
    t, h, d = x.shape
    if out.shape != x.shape or out.dtype != x.dtype or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"{name}: x {tuple(x.shape)} and out {tuple(out.shape)} must match in shape and "
                         "dtype and have a contiguous last dim")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: positions must be [T={t}] int32/int64, got {positions.dtype} "
                         f"of shape {tuple(positions.shape)}")
    half = inv_freq.shape[0] if inv_freq.dim() == 1 else -1
    if half < 1 or 2 * half > d or inv_freq.dtype != torch.float32 or inv_freq.stride(0) != 1:
        raise ValueError(f"{name}: inv_freq must be a contiguous float32 [R/2] with 1 <= R <= D={d}, got "
                         f"{inv_freq.dtype} of shape {tuple(inv_freq.shape)}")
    if weight is not None and (weight.shape != (d,) or weight.dtype != torch.float32
                               or weight.stride(0) != 1):
        raise ValueError(f"{name}: weight must be a contiguous float32 [D={d}], got {weight.dtype} of "
                         f"shape {tuple(weight.shape)}")
    if cache is not None:
        if cache.dim() != 5 or cache.shape[3:] != (1, d) or cache.stride(-1) != 1 or h != 1:
            raise ValueError(f"{name}: cache must be [NB, bs, nt, 1, D={d}] with a contiguous last dim "
                             f"for a one-head input, got cache {tuple(cache.shape)}, {h} heads")
        if slot_mapping is None or slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32,
                                                                                          torch.int64):
            raise ValueError(f"{name}: slot_mapping must be [T={t}] int32/int64 beside a cache")
    for other in (out, positions, inv_freq, weight, cache, slot_mapping):
        if other is not None and other.device != x.device:
            raise ValueError(f"{name}: every tensor must be on {x.device}, got one on {other.device}")


def _launch(x: torch.Tensor, out: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
            scaling: float, inverse: bool, norm: int, eps: float, weight: torch.Tensor | None,
            cache: torch.Tensor | None, slot_mapping: torch.Tensor | None, name: str) -> None:
    _check(x, out, positions, inv_freq, weight, cache, slot_mapping, name)
    t, h, d = x.shape
    half = inv_freq.shape[0]
    if t == 0:
        return
    # Tile config: one program per (token, block of heads); a block holds up to 4096 elements of
    # full rows (8 heads at D=512), so V4-Flash's 64 query heads spread over 8 programs per token.
    block_d = triton.next_power_of_2(d)
    block_h = min(triton.next_power_of_2(h), max(1, 4096 // block_d))
    placeholder = x           # stands in for the absent weight / cache / slots, never read then
    _norm_rope_kernel[(t, triton.cdiv(h, block_h))](
        x, out, weight if weight is not None else placeholder, positions, inv_freq,
        cache if cache is not None else placeholder,
        slot_mapping if slot_mapping is not None else positions,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cache.stride(0) if cache is not None else 0, cache.stride(1) if cache is not None else 0,
        h, d, cache.shape[1] if cache is not None else 1,
        float(scaling), -1.0 if inverse else 1.0, float(eps),
        HALF=half, NORM=norm, HAS_CACHE=cache is not None,
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_HALF=triton.next_power_of_2(half), num_warps=4,
        **pdl.flags(x.device))


def q_norm_rope(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                eps: float) -> torch.Tensor:
    """Per-head unweighted RMS norm then the rope: q [T, H, D] -> new [T, H, D]."""
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _launch(q, out, positions, inv_freq, scaling, False, UNWEIGHTED, eps, None, None, None, "q_norm_rope")
    return out


def kv_norm_rope(kv: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 scaling: float, eps: float, cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """V4 RMSNorm (float32 weight) then the rope: kv [T, D] -> new [T, D]; with ``cache``
    [NB, bs, nt, 1, D] also writes each row to tensor 0 at ``slot_mapping`` [T] (-1 skipped)."""
    if kv.dim() != 2:
        raise ValueError(f"kv_norm_rope: kv must be [T, D], got shape {tuple(kv.shape)}")
    out = torch.empty_like(kv, memory_format=torch.contiguous_format)
    _launch(kv[:, None], out[:, None], positions, inv_freq, scaling, False, WEIGHTED, eps, weight, cache,
            slot_mapping, "kv_norm_rope")
    return out


def interleaved_rope_(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                      inverse: bool = False) -> torch.Tensor:
    """Rotate x [T, H, D] in place at ``positions`` [T] (``inverse``: by minus the angle); returns x."""
    half = inv_freq.shape[0] if inv_freq.dim() == 1 else 0
    if x.dim() == 3 and half >= 1 and half & (half - 1) == 0 and 2 * half <= x.shape[2]:
        _check(x, x, positions, inv_freq, None, None, None, "interleaved_rope_")
        t, h, d = x.shape
        if t == 0:
            return x
        # Tile config: up to 4096 rope channels a program (64 heads at R=64), and blocks of 4
        # tokens once there are enough tokens for a wave of programs.
        block_h = min(triton.next_power_of_2(h), max(1, 4096 // (2 * half)))
        block_t = 4 if t >= 2048 else 1
        _rope_kernel[(triton.cdiv(t, block_t), triton.cdiv(h, block_h))](
            x, positions, inv_freq, t, x.stride(0), x.stride(1), h, d - 2 * half, float(scaling),
            -1.0 if inverse else 1.0, HALF=half, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
            **pdl.flags(x.device))
        return x
    _launch(x, x, positions, inv_freq, scaling, inverse, NO_NORM, 0.0, None, None, None, "interleaved_rope_")
    return x

