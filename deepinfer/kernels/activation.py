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


@triton.jit
def _clamped_swiglu_kernel(gate_ptr, up_ptr, out_ptr, width, gate_stride, up_stride, limit,
                           CLAMP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_ptr + t * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + t * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + t * width + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up: [T, I] (unit column stride) -> [T, I] in gate's dtype; no clamp when ``limit`` is 0."""
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"clamped_swiglu: gate and up must both be [T, I], got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("clamped_swiglu: gate and up need a unit column stride")
    t, width = gate.shape
    out = torch.empty(t, width, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    # Tile config: 1024 columns per program (4 warps, 8 per thread); one row of the grid per token.
    block = min(triton.next_power_of_2(width), 1024)
    _clamped_swiglu_kernel[(t, triton.cdiv(width, block))](
        gate, up, out, width, gate.stride(0), up.stride(0), float(limit),
        CLAMP=limit > 0, BLOCK=block, num_warps=4, **pdl.flags(gate.device))
    return out
