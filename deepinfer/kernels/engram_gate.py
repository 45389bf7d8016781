"""DeepSeek-V4.1 engram gate: each stream plus its gated share of the engram value; reference:
:func:`reference.engram_gate`.

For token t and stream k (D values each):

    dot  = sum(s_k * w_k * key_k) * rsqrt(mean(s_k^2) + eps) * rsqrt(mean(key_k^2) + eps) / sqrt(D)
    gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))          (the sign of -0.0 kept)
    out_k = s_k + gate * value

in float32, rounded to the streams' dtype once. Grid (T, n): a program walks its stream's D
values twice in tiles of BLOCK_D, first accumulating the three sums (per lane, reduced once at
the end), then writing ``s_k + gate * value``; the stream and value rows are read twice, the
key once. Square roots are correctly rounded (``sqrt_rn``), so the result differs from the
reference only by summation order and the exponential's rounding. The streams may be any
strided view ([T, n, D] with D contiguous; the first layer's are a stride-0 expansion of one
row). No host synchronisation (CUDA-graph safe).

Shapes: T tokens, n streams, D hidden size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

# Values of one tile: the release's D = 5120 in 5 tiles of 1024, 8 float32 a thread for each
# of the three accumulators at 4 warps.
_BLOCK_D = 1024


@triton.jit
def _engram_gate_kernel(
    streams_ptr, kv_ptr, weight_ptr, out_ptr,
    eps, inv_sqrt_d,
    stride_streams_t, stride_streams_n, stride_kv_t, stride_weight_n, stride_out_t, stride_out_n,
    N_STREAMS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1).to(tl.int64)
    h_row = streams_ptr + t * stride_streams_t + k * stride_streams_n
    key_row = kv_ptr + t * stride_kv_t + k * HIDDEN
    value_row = kv_ptr + t * stride_kv_t + N_STREAMS * HIDDEN
    w_row = weight_ptr + k * stride_weight_n
    sum_hh = tl.zeros([BLOCK_D], tl.float32)
    sum_kk = tl.zeros([BLOCK_D], tl.float32)
    sum_dot = tl.zeros([BLOCK_D], tl.float32)
    for d0 in range(0, HIDDEN, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = d < HIDDEN
        h = tl.load(h_row + d, mask=ok, other=0.0).to(tl.float32)
        key = tl.load(key_row + d, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_row + d, mask=ok, other=0.0)
        sum_hh += h * h
        sum_kk += key * key
        sum_dot += h * w * key
    rstd = (1.0 / tl.sqrt_rn(tl.sum(sum_hh, axis=0) / HIDDEN + eps)) \
        * (1.0 / tl.sqrt_rn(tl.sum(sum_kk, axis=0) / HIDDEN + eps))
    dot = tl.sum(sum_dot, axis=0) * rstd * inv_sqrt_d
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), 1e-6))
    signed = tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root)           # copysign(root, dot)
    gate = 1.0 / (1.0 + tl.exp(-signed))
    out_row = out_ptr + t * stride_out_t + k * stride_out_n
    for d0 in range(0, HIDDEN, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        ok = d < HIDDEN
        h = tl.load(h_row + d, mask=ok, other=0.0).to(tl.float32)
        value = tl.load(value_row + d, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_row + d, (h + gate * value).to(out_ptr.dtype.element_ty), mask=ok)


def engram_gate(streams: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """streams: [T, n, D] (any strides, D contiguous); kv: [T, (n+1)*D] (n keys stream-major,
    then the value; rows contiguous); weight: [n, D] float32 -> new streams [T, n, D] in the
    streams' dtype (see the module docstring)."""
    if streams.dim() != 3 or streams.stride(2) != 1:
        raise ValueError(f"engram_gate: streams must be [T, n, D] with D contiguous, got shape "
                         f"{tuple(streams.shape)} strides {streams.stride()}")
    t, n, d = streams.shape
    if kv.shape != (t, (n + 1) * d) or kv.stride(1) != 1:
        raise ValueError(f"engram_gate: kv must be [{t}, {(n + 1) * d}] with its last dim contiguous, got "
                         f"shape {tuple(kv.shape)} strides {kv.stride()}")
    if weight.shape != (n, d) or weight.dtype != torch.float32 or weight.stride(1) != 1:
        raise ValueError(f"engram_gate: weight must be float32 [{n}, {d}] with D contiguous, got "
                         f"{weight.dtype} of shape {tuple(weight.shape)}")
    for name, x in (("kv", kv), ("weight", weight)):
        if x.device != streams.device:
            raise ValueError(f"engram_gate: {name} is on {x.device}, the streams on {streams.device}")
    out = torch.empty(t, n, d, dtype=streams.dtype, device=streams.device)
    if t == 0:
        return out
    # Tile config: D in tiles of _BLOCK_D (the whole row when smaller); 4 warps.
    block_d = min(_BLOCK_D, triton.next_power_of_2(d))
    _engram_gate_kernel[(t, n)](
        streams, kv, weight, out, float(eps), d ** -0.5,
        streams.stride(0), streams.stride(1), kv.stride(0), weight.stride(0), out.stride(0), out.stride(1),
        N_STREAMS=n, HIDDEN=d, BLOCK_D=block_d, num_warps=4, **pdl.flags(streams.device))
    return out
