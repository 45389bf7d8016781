"""Fused mixture-of-experts over FP4 experts as shipped: routed SwiGLU experts as two grouped
GEMMs whose weights are packed e2m1 (two values a byte, low nibble first) with one scale per 32
inputs, float32 (DeepSeek-V4) or UE8M0 bytes (V4.1, i.e. MXFP4); reference:
:func:`reference.fp4_moe_experts`.

Hopper has no FP4 tensor cores: each weight tile is dequantised in registers (code -> value,
times its group's scale, in float32, rounded once to the activations' dtype) and multiplied on
the 16-bit tensor cores. The weights are read as bytes, a quarter of bf16's, which is what
decode is bound by.

Same routing interface and sorting as :mod:`fused_moe` (whose align and slot-sum kernels this
file reuses, so the MoE layers switch by weight format alone): pairs sorted by expert into
``block_m``-row blocks (:func:`fused_moe.moe_align`), then

* gate_up (grid M-blocks x I/BLOCK_N): rows of x gathered by pair times the block's expert's
  gate and up rows, clamped SwiGLU in the epilogue; act [P, I] by pair.
* down (grid M-blocks x H/BLOCK_N): act rows times the expert's down rows, times the pair's
  float32 routing weight, rounded once; then each token's K rows summed in float32.

No host synchronisation (grids from T, K and E alone), so decode steps can be captured in CUDA
graphs. The packed byte j of a row holds inputs 2j (low nibble) and 2j+1 (high nibble); rather
than interleave the two halves of the weight tile in registers, the activation tile is split into
its even and odd columns and each K step runs two MMAs of half width.

Accuracy: the kernel computes exactly the reference's products of x with the dequantised
(rounded to x's dtype) weights, up to float32 accumulation order: the same tolerance as the
bf16 fused MoE kernel. Against the original unquantised weights the error is the format's: e2m1
keeps 1 mantissa bit, about 0.10-0.12 relative RMS error per weight on Gaussian values, and the
routed output (two FP4 GEMMs) about 0.2 relative (tests/kernels/test_fp4_moe.py allows 0.3).

Shapes: T tokens, H hidden, E experts, K experts per token, I expert width (H and I multiples of
32), P = T*K (token, slot) pairs.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.fused_moe import MoEConfig, _tile, check_routing, moe_align, pick_config, sum_slots

GROUP = 32          # inputs per scale


@triton.jit
def _e2m1(code):
    """uint8 e2m1 codes (sign in bit 3) -> float32 values: 0, 0.5, then 2^(i/2 - 1) * (1 + (i & 1)/2),
    built from float32 bits (exact; the hardware exp2 is approximate)."""
    i = (code & 7).to(tl.int32)
    normal = ((((i >> 1) + 126) << 23) | ((i & 1) << 22)).to(tl.float32, bitcast=True)
    mag = tl.where(i < 2, i.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _dequant_halves(w_ptrs, s_ptrs, mask, S_E8M0: tl.constexpr, dtype: tl.constexpr):
    """A [BLOCK_K/2, BLOCK_N] tile of packed bytes and the scales of its inputs -> (values of the
    even inputs, values of the odd inputs), each [BLOCK_K/2, BLOCK_N] in ``dtype``."""
    b = tl.load(w_ptrs, mask=mask, other=0)
    s = tl.load(s_ptrs, mask=mask, other=0)
    if S_E8M0:
        s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)                # 2 ** (b - 127)
    return (_e2m1(b & 15) * s).to(dtype), (_e2m1(b >> 4) * s).to(dtype)


@triton.jit
def _fp4_gate_up_kernel(
    x, wq, ws, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter, num_pid_m, limit,
    stride_x, stride_qe, stride_qn, stride_se, stride_sn, stride_act,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_LIMIT: tl.constexpr, S_E8M0: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_pid_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):                        # past the padded total: exit
        return
    HALF: tl.constexpr = BLOCK_K // 2
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                            # [BLOCK_N] of I
    col_ok = cols < inter
    js = tl.arange(0, HALF)                                                   # byte j: inputs 2j, 2j+1
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x + (pair // TOP_K).to(tl.int64)[:, None] * stride_x + ks[None, :]       # [BLOCK_M, BLOCK_K]
    g_rows = expert * stride_qe + cols[None, :].to(tl.int64) * stride_qn
    u_rows = g_rows + inter * stride_qn
    gs_rows = expert * stride_se + cols[None, :].to(tl.int64) * stride_sn
    us_rows = gs_rows + inter * stride_sn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dtype = x.dtype.element_ty
    for k in range(tl.cdiv(hidden, BLOCK_K)):
        k0 = k * BLOCK_K
        in_k = (k0 + 2 * js) < hidden                                         # [HALF]
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & ((k0 + ks) < hidden)[None, :], other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, HALF, 2]))          # inputs 2j, 2j+1
        byte = (k * HALF + js)[:, None]                                       # [HALF, 1]
        group = ((k0 + 2 * js) // 32)[:, None]
        mask = in_k[:, None] & col_ok[None, :]
        g_lo, g_hi = _dequant_halves(wq + g_rows + byte, ws + gs_rows + group, mask, S_E8M0, dtype)
        u_lo, u_hi = _dequant_halves(wq + u_rows + byte, ws + us_rows + group, mask, S_E8M0, dtype)
        gate = tl.dot(a_even, g_lo, gate, input_precision=DOT_PRECISION)
        gate = tl.dot(a_odd, g_hi, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a_even, u_lo, up, input_precision=DOT_PRECISION)
        up = tl.dot(a_odd, u_hi, up, input_precision=DOT_PRECISION)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * stride_act + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _fp4_down_kernel(
    act, wq, ws, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter, num_pid_m,
    stride_act, stride_qe, stride_qn, stride_se, stride_sn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, S_E8M0: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_pid_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    HALF: tl.constexpr = BLOCK_K // 2
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                            # [BLOCK_N] of H
    col_ok = cols < hidden
    js = tl.arange(0, HALF)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act + pair.to(tl.int64)[:, None] * stride_act + ks[None, :]     # [BLOCK_M, BLOCK_K]
    w_rows = expert * stride_qe + cols[None, :].to(tl.int64) * stride_qn
    s_rows = expert * stride_se + cols[None, :].to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dtype = act.dtype.element_ty
    for k in range(tl.cdiv(inter, BLOCK_K)):
        k0 = k * BLOCK_K
        in_k = (k0 + 2 * js) < inter
        a = tl.load(a_ptrs + k0, mask=valid[:, None] & ((k0 + ks) < inter)[None, :], other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, HALF, 2]))
        byte = (k * HALF + js)[:, None]
        group = ((k0 + 2 * js) // 32)[:, None]
        w_lo, w_hi = _dequant_halves(wq + w_rows + byte, ws + s_rows + group,
                                     in_k[:, None] & col_ok[None, :], S_E8M0, dtype)
        acc = tl.dot(a_even, w_lo, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(a_odd, w_hi, acc, input_precision=DOT_PRECISION)
    out_rows = pair.to(tl.int64)
    weight = tl.load(weights_ptr + out_rows, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_rows[:, None] * stride_out + cols[None, :],
             (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def fp4_pick_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                    elem_bytes: int = 2) -> MoEConfig:
    """:func:`fused_moe.pick_config`'s tiles by pairs per expert, with pointer loads (the packed
    bytes are dequantised in registers, so no TMA tiles and act stays by pair), K steps of at
    least 32 inputs (each MMA then reduces over 16), and for the 128-row prefill blocks half-width
    N-tiles: the dequantised tiles take registers, and the full ones spilled (sm_90 compile,
    ``scripts/probes/sm90_resources.py``)."""
    cfg = pick_config(num_tokens, top_k, num_experts, hidden, inter, elem_bytes)
    if cfg.block_m >= 128:
        cfg = dataclasses.replace(cfg, block_n1=min(cfg.block_n1, 64), block_n2=min(cfg.block_n2, 128))
    return dataclasses.replace(cfg, tma=False, sorted_act=False, block_k1=max(32, cfg.block_k1),
                               block_k2=max(32, cfg.block_k2), num_stages=min(cfg.num_stages, 3))


def _check_fp4(q: torch.Tensor, s: torch.Tensor, e: int, n: int, k: int, name: str) -> None:
    if q.dtype != torch.uint8 or tuple(q.shape) != (e, n, k // 2) or q.stride(2) != 1:
        raise ValueError(f"fp4_moe: {name} must be uint8 [E={e}, {n}, {k // 2}] (two e2m1 codes a byte) with "
                         f"unit last stride, got {q.dtype} shape {tuple(q.shape)}")
    if tuple(s.shape) != (e, n, k // GROUP) or s.stride(2) != 1 or s.dtype not in (torch.float32, torch.uint8):
        raise ValueError(f"fp4_moe: {name} scales must be float32 or UE8M0 bytes (uint8) [E={e}, {n}, "
                         f"{k // GROUP}] with unit last stride, got {s.dtype} shape {tuple(s.shape)}")


def fp4_moe(x: torch.Tensor, gate_up_q: torch.Tensor, gate_up_s: torch.Tensor, down_q: torch.Tensor,
            down_s: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            swiglu_limit: float = 0.0, config: MoEConfig | None = None, invariant: bool = False) -> torch.Tensor:
    """``sum_k w[t,k] * down_e(silu(min(g, L)) * clamp(u, -L, L))``, (g, u) = gate_up_e(x_t), with the
    experts' weights in FP4 (see :func:`reference.fp4_moe_experts`).

    x: [T, H] (bf16/fp16/float32); gate_up_q: [E, 2I, H/2] uint8 with gate_up_s [E, 2I, H/32];
    down_q: [E, H, I/2] with down_s [E, H, I/32] (scales float32 or UE8M0 bytes, both projections
    alike); topk_weights [T, K] float32; topk_ids [T, K] integer -> [T, H] in x's dtype. A slot whose
    id is outside [0, E) contributes nothing. ``config`` overrides :func:`fp4_pick_config`;
    ``invariant`` (batch-invariant mode) takes its decode config for every T (as
    :func:`fused_moe.fused_moe`).
    """
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"fp4_moe: x must be [T, H] with unit column stride, got shape {tuple(x.shape)}")
    t, h = x.shape
    if gate_up_q.dim() != 3 or gate_up_q.shape[1] % 2:
        raise ValueError(f"fp4_moe: gate_up_q has shape {tuple(gate_up_q.shape)}, expected [E, 2I, H/2]")
    e, i = gate_up_q.shape[0], gate_up_q.shape[1] // 2
    if h % GROUP or i % GROUP:
        raise ValueError(f"fp4_moe: H={h} and I={i} must be multiples of the scale group {GROUP}")
    _check_fp4(gate_up_q, gate_up_s, e, 2 * i, h, "gate_up")
    _check_fp4(down_q, down_s, e, h, i, "down")
    if gate_up_s.dtype != down_s.dtype:
        raise ValueError(f"fp4_moe: gate_up scales ({gate_up_s.dtype}) and down scales ({down_s.dtype}) differ")
    check_routing("fp4_moe", t, topk_weights, topk_ids, swiglu_limit)
    k = topk_ids.shape[1]
    pairs = t * k
    if pairs == 0:
        return torch.zeros_like(x)
    cfg = config or fp4_pick_config(1 if invariant else t, k, e, h, i, x.element_size())
    if cfg.tma or cfg.sorted_act:
        raise ValueError("fp4_moe: the FP4 kernels load by pointer; configs with tma or sorted_act are not supported")
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    s_e8m0 = gate_up_s.dtype == torch.uint8
    out = torch.empty(pairs, h, dtype=x.dtype, device=x.device)             # [P, H]
    sorted_pairs, block_expert, num_padded = moe_align(topk_ids.contiguous(), e, cfg.block_m, out)
    num_pid_m = block_expert.shape[0]
    act = torch.empty(pairs, i, dtype=x.dtype, device=x.device)             # [P, I]
    _fp4_gate_up_kernel[(num_pid_m * triton.cdiv(i, cfg.block_n1),)](
        x, gate_up_q, gate_up_s, act, sorted_pairs, block_expert, num_padded,
        pairs, h, i, num_pid_m, float(swiglu_limit),
        x.stride(0), gate_up_q.stride(0), gate_up_q.stride(1), gate_up_s.stride(0), gate_up_s.stride(1),
        act.stride(0),
        TOP_K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1, GROUP_M=cfg.group_m,
        HAS_LIMIT=swiglu_limit > 0, S_E8M0=s_e8m0, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.flags(x.device))
    _fp4_down_kernel[(num_pid_m * triton.cdiv(h, cfg.block_n2),)](
        act, down_q, down_s, out, topk_weights.contiguous(), sorted_pairs, block_expert, num_padded,
        pairs, h, i, num_pid_m,
        act.stride(0), down_q.stride(0), down_q.stride(1), down_s.stride(0), down_s.stride(1), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, GROUP_M=cfg.group_m,
        S_E8M0=s_e8m0, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.flags(x.device))
    return sum_slots(out, t, k)
