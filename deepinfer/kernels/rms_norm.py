"""RMSNorm as one Triton program per row; reference: :func:`reference.rms_norm`.

Each program loads its whole row once (the row fits in registers up to
``MAX_COLS`` columns), so the kernel reads x and writes y exactly once: it is
bound by memory bandwidth. The sum of squares runs in float32; the normalised
row is rounded to x's dtype before the weight multiplies (Llama/Qwen, HF), or,
with ``round_first=False`` (DeepSeek-V4), the weight multiplies in float32 and
the result is rounded once to x's dtype.

:func:`inv_rms` and :func:`row_config` are shared with the kernels that fuse this norm
into the op producing its input (``hyper_connection._hc_collapse_kernel``): same
reduction over a row tile of the same width and warp count, so the fused result
equals this kernel's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.fp8_gemm import check_quant_group, store_quant_groups

# Above this a row no longer fits one program's registers; such a norm would
# need a looped kernel (no supported model has a hidden size near it).
MAX_COLS = 65536


def row_config(n_cols: int) -> tuple[int, int]:
    """(block, num_warps) of a program that holds a whole row of ``n_cols``: one warp per
    256 elements keeps about 8 float32 values per thread, up to 16 warps."""
    block = triton.next_power_of_2(n_cols)
    return block, min(16, max(1, block // 256))


@triton.jit
def inv_rms(x, n_cols, eps):
    """``1 / sqrt(mean(x^2) + eps)`` of a float32 row tile x [BLOCK] that is zero past
    ``n_cols`` (the reduction a fused caller must share to match this kernel bitwise)."""
    return tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, q_ptr, s_ptr,
    x_row_stride, out_row_stride,
    n_cols, eps,
    BLOCK: tl.constexpr, ROUND_FIRST: tl.constexpr, QUANT_GROUP: tl.constexpr = 0, POW2: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    normed = x * inv_rms(x, n_cols, eps)
    if ROUND_FIRST:
        # Round to x's dtype first: the reference multiplies the weight in that dtype.
        normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (normed * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, y, mask=mask)
    if QUANT_GROUP > 0:
        # The rounded output quantised for an FP8 linear (dense [rows, n_cols] codes and
        # [rows, n_cols / QUANT_GROUP] scales), as fp8_act_quant would quantise it.
        store_quant_groups(y.to(tl.float32), q_ptr + row * n_cols, s_ptr + row * (n_cols // QUANT_GROUP), 0,
                           n_cols, QUANT_GROUP, POW2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True,
             fp8: tuple[int, bool] | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim.

    x: [..., D]; weight: [D] -> [..., D] in the promoted dtype of x and weight
    (``round_first``), else in x's dtype. ``fp8`` = (group, pow2_scale): also the output
    quantised for an FP8 linear in the same launch, returned as (out, codes [N, D] e4m3,
    scales [N, D/group] float32), N the rows: :func:`fp8_gemm.fp8_act_quant` of out, bit for bit.
    """
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({d},)")
    if d > MAX_COLS:
        raise ValueError(f"rms_norm: last dim {d} exceeds the kernel's limit of {MAX_COLS}")
    if x.device != weight.device:
        raise ValueError(f"rms_norm: x on {x.device} but weight on {weight.device}")
    x2 = x.reshape(-1, d)                                            # [N, D], a view when it can be
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight.contiguous()
    out_dtype = torch.promote_types(x.dtype, weight.dtype) if round_first else x.dtype
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    group, pow2 = fp8 or (0, False)
    if fp8 is not None:
        check_quant_group(group, d)
        q = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(x2.shape[0], d // group, dtype=torch.float32, device=x.device)
    else:
        q = s = out
    if x2.shape[0]:
        block, num_warps = row_config(d)                             # the whole row in one block
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, out, q, s, x2.stride(0), out.stride(0), d, eps,
            BLOCK=block, ROUND_FIRST=round_first, QUANT_GROUP=group, POW2=pow2, num_warps=num_warps,
            **pdl.flags(x2.device))
    return out.view(x.shape) if fp8 is None else (out.view(x.shape), q, s)
