"""Clamped SwiGLU of the DeepSeek-V4 shared expert in one launch; reference:
:func:`reference.clamped_swiglu`.

``out = silu(min(gate, L)) * clamp(up, -L, L)`` elementwise, in float32, rounded
once to the output dtype. The torch path is four launches (two clamps, silu,
product), each a round trip of [T, I] through memory; at decode they are
launch-bound, so one kernel saves three launches per layer. gate and up may be
column slices of one fused projection output (any row stride).

Shapes: T tokens, I expert width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.fp8_gemm import check_quant_group, store_quant_groups


@triton.jit
def _clamped_swiglu_kernel(gate_ptr, up_ptr, out_ptr, q_ptr, s_ptr, width, gate_stride, up_stride, limit,
                           CLAMP: tl.constexpr, BLOCK: tl.constexpr, QUANT_GROUP: tl.constexpr = 0,
                           POW2: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_ptr + t * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    out = (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * width + cols, out, mask=mask)
    if QUANT_GROUP > 0:
        # The output quantised for the FP8 down projection (BLOCK is whole groups), as
        # fp8_act_quant would quantise it.
        store_quant_groups(out.to(tl.float32), q_ptr + t * width, s_ptr + t * (width // QUANT_GROUP),
                           tl.program_id(1) * BLOCK, width, QUANT_GROUP, POW2)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, fp8: tuple[int, bool] | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up: [T, I] (unit column stride) -> [T, I] in gate's dtype; no clamp when ``limit`` is 0.
    ``fp8`` = (group, pow2_scale): also the output quantised for an FP8 linear by the same
    launch, returned as (out, codes [T, I] e4m3, scales [T, I/group] float32):
    :func:`fp8_gemm.fp8_act_quant` of out, bit for bit."""
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate and up must both be [T, I], got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("clamped_swiglu: gate and up need a unit column stride")
    t, width = gate.shape
    out = torch.empty(t, width, dtype=gate.dtype, device=gate.device)
    group, pow2 = fp8 or (0, False)
    if fp8 is not None:
        check_quant_group(group, width, "clamped_swiglu")
        q = torch.empty(t, width, dtype=torch.float8_e4m3fn, device=gate.device)
        s = torch.empty(t, width // group, dtype=torch.float32, device=gate.device)
    else:
        q = s = out
    if out.numel():
        # Tile config: 1024 columns per program (4 warps, 8 per thread; whole activation groups);
        # one row of the grid per token.
        block = min(triton.next_power_of_2(width), 1024)
        _clamped_swiglu_kernel[(t, triton.cdiv(width, block))](
            gate, up, out, q, s, width, gate.stride(0), up.stride(0), float(limit),
            CLAMP=limit > 0, BLOCK=block, QUANT_GROUP=group, POW2=pow2, num_warps=4, **pdl.flags(gate.device))
    return out if fp8 is None else (out, q, s)
