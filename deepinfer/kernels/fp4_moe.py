"""Fused mixture-of-experts over FP4 experts as shipped: routed SwiGLU experts as two grouped
GEMMs whose weights are packed e2m1 (two values a byte, low nibble first) with one scale per 32
inputs, float32 (DeepSeek-V4) or UE8M0 bytes (V4.1, i.e. MXFP4); references:
:func:`reference.fp4_moe_experts`, :func:`reference.fp4_moe_experts_fp8` (FP8 dots).

Hopper has no FP4 tensor cores: the weights are read as bytes, a quarter of bf16's (what decode
is bound by), and decoded in registers. Two paths (:class:`FP4Kernel`, picked by
:func:`fp4_pick_kernel`):

* group (default): each K step covers whole 32-input groups. A group's 16 bytes a column are
  turned into e4m3 bytes with a few integer ops (code c -> ``((c & 8) << 4) | ((c & 7) << 2)``,
  exactly the e2m1 value times 2^-6; on CUDA by inline PTX on 4 bytes a register), the low and
  high nibbles interleaved back into input order ([BLOCK_N, 32], K contiguous, used transposed
  as the dot's B operand), and the group's scale (one load a column, 2^6 folded in) applied
  after the group's dot, or (``scale="weight"``) to the decoded tile before
  a dot that accumulates in place (``wide``: a K step's groups as one byte load and one dot,
  instead of one a group; ``split``: the low and high nibbles kept apart and multiplied by the
  activations' even and odd inputs in two dots, no shuffle of the weight tile; wide and split
  are the default, :func:`fp4_pick_kernel`). Dots in the activations' dtype (``dot="bf16"``; the e4m3 codes
  convert exactly), or FP8 (``dot="fp8"``): x quantised once per token and 32 (or 64, 128)
  inputs to e4m3 with float32 scales (powers of two beside UE8M0 weights, as DeepSeek's
  ``scale_fmt``) by :func:`fp8_gemm.fp8_act_quant`, act likewise after gate_up, and each group's
  FP8 product scaled by the activation and weight scales.
* dequant (the first kernels, kept to compare against): each weight decoded to float32 (about
  15-20 instructions a value), times its scale, rounded to the activations' dtype, and the even
  and odd inputs of the bytes multiplied by two half-width MMAs.

Same routing interface and sorting as :mod:`fused_moe` (whose align and slot-sum kernels this
file reuses, so the MoE layers switch by weight format alone): pairs sorted by expert into
``block_m``-row blocks (:func:`fused_moe.moe_align`), then

* gate_up (grid M-blocks x I/BLOCK_N): rows of x gathered by pair times the block's expert's
  gate and up rows, clamped SwiGLU in the epilogue; act [P, I] by pair.
* down (grid M-blocks x H/BLOCK_N): act rows times the expert's down rows, times the pair's
  float32 routing weight, rounded once; then each token's K rows summed in float32.

No host synchronisation (grids from T, K and E alone), so decode steps can be captured in CUDA
graphs.

Accuracy. bf16 dots: the reference's products of x with the dequantised weights up to float32
accumulation order (the same tolerance as the bf16 fused MoE kernel): for UE8M0 scales the
products are bit-identical to dequantise-then-multiply; for float32 scales the group path is at
least as accurate (the scale stays float32 instead of being folded into a weight rounded to
bf16). FP8 dots: :func:`reference.fp4_moe_experts_fp8` up to accumulation order (and an act
element that lands on the other side of an e4m3 rounding boundary); the activations' e4m3
rounding (at most 2^-4 relative an element, twice: x and act) puts the output about 0.03-0.06
relative from the bf16-dot result on random data (tests allow 0.1). Against the original
unquantised weights the error is the format's: e2m1 keeps 1 mantissa bit, about 0.10-0.12
relative RMS error per weight on Gaussian values, and the routed output (two FP4 GEMMs) about 0.2
relative (tests/kernels/test_fp4_moe.py allows 0.3).

Shapes: T tokens, H hidden, E experts, K experts per token, I expert width (H and I multiples of
32), P = T*K (token, slot) pairs.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.fp8_gemm import fp8_act_quant
from deepinfer.kernels.fused_moe import (MoEConfig, _tile, check_routing, invariant_config, moe_align, pick_config,
                                        sum_slots)

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
def _store_swiglu(gate, up, limit, act_ptr, pair, stride_act, cols, valid, col_ok, HAS_LIMIT: tl.constexpr):
    """gate_up's epilogue: the clamped SwiGLU of a [BLOCK_M, BLOCK_N] tile, stored by pair."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(gate) * up
    tl.store(act_ptr + pair.to(tl.int64)[:, None] * stride_act + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _store_weighted(acc, weights_ptr, out_ptr, out_rows, stride_out, cols, valid, col_ok):
    """down's epilogue: each pair's row times its float32 routing weight, rounded once, stored by pair."""
    weight = tl.load(weights_ptr + out_rows, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + out_rows[:, None] * stride_out + cols[None, :],
             (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


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
    _store_swiglu(gate, up, limit, act_ptr, pair, stride_act, cols, valid, col_ok, HAS_LIMIT)


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
    _store_weighted(acc, weights_ptr, out_ptr, out_rows, stride_out, cols, valid, col_ok)


# -- group path: e2m1 codes as e4m3 bytes, one scale load per column and 32-input group ---------

# e2m1 code c (sign bit 3, magnitude bits 2..0) as the e4m3 byte ((c & 8) << 4) | ((c & 7) << 2):
# the sign moves to bit 7 and the magnitude's 2 exponent bits and 1 mantissa bit land in e4m3's
# low exponent bits and top mantissa bit, which is exactly the e2m1 value times 2^-6 (code 1, 0.5,
# becomes e4m3's subnormal 2^-7). The kernels fold the 2^6 into the group's scale.
_E4M3_FROM_E2M1 = tl.constexpr(64.0)

# The same on 4 packed bytes at once (one 32-bit register; the masks keep each byte's bits in that
# byte): about one instruction per value. Every read of $2 precedes the writes of $0 and $1, which
# may share its register.
_NIBBLES_TO_E4M3_ASM = tl.constexpr("""
{
.reg .b32 a, b, c, d;
shl.b32 a, $2, 4;
shl.b32 b, $2, 2;
shr.b32 c, $2, 2;
and.b32 d, $2, 0x80808080;
and.b32 a, a, 0x80808080;
and.b32 b, b, 0x1C1C1C1C;
and.b32 c, c, 0x1C1C1C1C;
or.b32 $0, a, b;
or.b32 $1, d, c;
}
""")


@triton.jit
def _nibbles_to_e4m3(b, ASM: tl.constexpr):
    """uint8 packed bytes -> (e4m3 of the low nibbles, e4m3 of the high nibbles), each an e2m1
    value times 2^-6, exactly. ``ASM``: 4 bytes a register by inline PTX (CUDA only; the CPU
    interpreter runs the plain byte ops)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_TO_E4M3_ASM, "=r,=r,r", [b], dtype=(tl.uint8, tl.uint8),
                                           is_pure=True, pack=4)
    else:
        lo = ((b << 4) & 0x80) | ((b << 2) & 0x1C)
        hi = (b & 0x80) | ((b >> 2) & 0x1C)
    return lo.to(tl.float8e4nv, bitcast=True), hi.to(tl.float8e4nv, bitcast=True)


# e2m1 code c straight into bf16 bits: the sign to bit 15, the magnitude's 2 exponent bits and 1
# mantissa bit to bf16's low exponent bits and top mantissa bit, ((c & 8) << 12) | ((c & 7) << 6):
# exactly the e2m1 value times 2^-126 (codes 0 and 1 land on bf16's subnormals). The kernels fold
# 2^126 into the group's scale, which then stays finite in bf16 for UE8M0 bytes up to 128 (scales
# up to 2^1; quantised weights' scales are far below). The same as _NIBBLES_TO_E4M3_ASM without the
# e4m3 -> bf16 conversion after it.
_BF16_FROM_E2M1 = tl.constexpr(2.0 ** 126)


def _bf16_pair_ptx(dst: str, spread: str, mag_shift: int, sign_shift: int) -> str:
    """PTX for one bf16 pair from a spread register (one byte a 16-bit half): each half's nibble
    magnitude shifted to bits 6..8 and its sign to bit 15."""
    return (f"shl.b32 m, {spread}, {mag_shift};\nshl.b32 s, {spread}, {sign_shift};\n"
            f"and.b32 m, m, 0x01C001C0;\nand.b32 s, s, 0x80008000;\nor.b32 {dst}, m, s;\n")


# On 4 packed bytes b0..b3 in one register: two permutes spread them to [b0, 0, b1, 0] and
# [b2, 0, b3, 0], so that each 16-bit half holds one byte and one shift a field serves both halves;
# $0, $1 take the low nibbles (bf16 pairs (b0, b1), (b2, b3)), $2, $3 the high ones. $4 is read in
# full before any output is written.
_NIBBLES_TO_BF16_ASM = tl.constexpr(
    "{\n.reg .b32 y0, y1, z, m, s;\nmov.b32 z, 0;\n"
    "prmt.b32 y0, $4, z, 0x4140;\nprmt.b32 y1, $4, z, 0x4342;\n"
    + _bf16_pair_ptx("$0", "y0", 6, 12) + _bf16_pair_ptx("$1", "y1", 6, 12)        # low nibbles
    + _bf16_pair_ptx("$2", "y0", 2, 8) + _bf16_pair_ptx("$3", "y1", 2, 8)          # high nibbles
    + "}\n")


@triton.jit
def _nibbles_to_bf16(b, ASM: tl.constexpr):
    """uint8 packed bytes -> (bf16 of the low nibbles, bf16 of the high nibbles), each an e2m1
    value times 2^-126, exactly. ``ASM``: 4 bytes a register by inline PTX (CUDA only)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_NIBBLES_TO_BF16_ASM, "=r,=r,=r,=r,r", [b],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        return lo, hi
    w = b.to(tl.uint16)
    lo = ((w & 8) << 12) | ((w & 7) << 6)
    hi = ((w & 128) << 8) | ((w & 112) << 2)
    return lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True)


@triton.jit
def _group_dot(acc, a, sa, w_ptrs, s_ptrs, mask_n, ok, S_E8M0: tl.constexpr, FP8: tl.constexpr,
               SCALE_W: tl.constexpr, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] float32 plus one 32-input group's product: activations a [BLOCK_M, 32]
    (e4m3 with per-row scales sa [BLOCK_M] when ``FP8``, else in the activations' dtype) times the
    group's weights, 16 packed bytes a column at ``w_ptrs`` [BLOCK_N, 16] with one scale a column
    at ``s_ptrs`` [BLOCK_N]. Each scale is loaded once per column and group. ``SCALE_W`` 0: the
    dot runs on the unscaled codes (exact in e4m3, bf16, fp16) and the scale multiplies its
    result; 1: the codes times the scale in float32, rounded to a's dtype (the reference's
    weights), accumulate in the MMA; 2: the same product in a's dtype (exact for power-of-two
    scales in bf16's range)."""
    b = tl.load(w_ptrs, mask=mask_n[:, None] & ok, other=0)
    lo, hi = _nibbles_to_e4m3(b, ASM)
    w = tl.interleave(lo, hi)                                         # [BLOCK_N, 32]: inputs in order
    s = tl.load(s_ptrs, mask=mask_n & ok, other=0)
    if S_E8M0:
        s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)      # 2 ** (b - 127)
    s = s * _E4M3_FROM_E2M1
    if FP8:
        return acc + tl.dot(a, tl.trans(w)) * (sa[:, None] * s[None, :])
    if SCALE_W == 0:
        return acc + tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=DOT_PRECISION) * s[None, :]
    if SCALE_W == 1:
        ws = (w.to(tl.float32) * s[:, None]).to(a.dtype)
    else:
        ws = w.to(a.dtype) * s.to(a.dtype)[:, None]
    return tl.dot(a, tl.trans(ws), acc, input_precision=DOT_PRECISION)


@triton.jit
def _scaled(w, s, SCALE_W: tl.constexpr, dtype: tl.constexpr):
    """Decoded e4m3 tile w times the broadcast scales s (float32, same shape) in ``dtype``
    (``SCALE_W`` as :func:`_group_dot`'s 1 or 2)."""
    if SCALE_W == 1:
        return (w.to(tl.float32) * s).to(dtype)
    return w.to(dtype) * s.to(dtype)


@triton.jit
def _wide_load(w_rows, s_rows, k, groups, mask_n, G: tl.constexpr):
    """K step k's weight bytes [BLOCK_N, 16G] (from the row starts ``w_rows`` [BLOCK_N]) and their
    scales [BLOCK_N, G]; a step past the last group loads nothing (all masked)."""
    kb = k * (16 * G) + tl.arange(0, 16 * G)                                  # [16G] bytes
    kg = k * G + tl.arange(0, G)                                              # [G] groups
    b = tl.load(w_rows[:, None] + kb[None, :], mask=mask_n[:, None] & (kb < groups * 16)[None, :], other=0)
    s = tl.load(s_rows[:, None] + kg[None, :], mask=mask_n[:, None] & (kg < groups)[None, :], other=0)
    return b, s


@triton.jit
def _wide_apply(acc, a, b, s, BLOCK_N: tl.constexpr, G: tl.constexpr, S_E8M0: tl.constexpr,
                SCALE_W: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr,
                BF16_BITS: tl.constexpr = False):
    """acc plus one K step over G groups: a [BLOCK_M, 32G] in the activations' dtype times the
    step's packed bytes b [BLOCK_N, 16G], decoded and times their scales s [BLOCK_N, G] (each
    loaded once and broadcast over its inputs). One dot over the low and high nibbles interleaved
    into input order, or (``SPLIT``) two dots of 16G inputs, the low nibbles with a's even columns
    and the high with its odd ones (no shuffle of the weight tile; a's, BLOCK_M x 32G, is the
    smaller at decode). ``BF16_BITS``: the codes decoded straight to bf16
    (:func:`_nibbles_to_bf16`) instead of through e4m3."""
    if S_E8M0:
        s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    if BF16_BITS:
        lo, hi = _nibbles_to_bf16(b, ASM)
        s = (s * _BF16_FROM_E2M1)[:, :, None]                               # [BLOCK_N, G, 1]
    else:
        lo, hi = _nibbles_to_e4m3(b, ASM)
        s = (s * _E4M3_FROM_E2M1)[:, :, None]
    if SPLIT:
        s16 = tl.reshape(tl.broadcast_to(s, [BLOCK_N, G, 16]), [BLOCK_N, 16 * G])
        a_even, a_odd = tl.split(tl.reshape(a, [a.shape[0], 16 * G, 2]))    # inputs 2j, 2j+1
        acc = tl.dot(a_even, tl.trans(_scaled(lo, s16, SCALE_W, a.dtype)), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(a_odd, tl.trans(_scaled(hi, s16, SCALE_W, a.dtype)), acc, input_precision=DOT_PRECISION)
    else:
        s32 = tl.reshape(tl.broadcast_to(s, [BLOCK_N, G, 32]), [BLOCK_N, 32 * G])
        w = _scaled(tl.interleave(lo, hi), s32, SCALE_W, a.dtype)            # [BLOCK_N, 32G] in input order
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _fp4g_gate_up_kernel(
    x, xs, wq, ws, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter, num_pid_m, limit,
    stride_x, stride_xs, stride_qe, stride_qn, stride_se, stride_sn, stride_act,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr,
    ACT_GROUP: tl.constexpr, GROUP_M: tl.constexpr, HAS_LIMIT: tl.constexpr, S_E8M0: tl.constexpr,
    FP8: tl.constexpr, SCALE_W: tl.constexpr, WIDE: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BF16_BITS: tl.constexpr = False, PREFETCH: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_pid_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):                        # past the padded total: exit
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                            # [BLOCK_N] of I
    col_ok = cols < inter
    token = (pair // TOP_K).to(tl.int64)
    a_ptrs = x + token[:, None] * stride_x + tl.arange(0, 32)[None, :]       # [BLOCK_M, 32]
    sa_ptrs = xs + token * stride_xs                                           # [BLOCK_M]
    g_rows = wq + expert * stride_qe + cols.to(tl.int64) * stride_qn          # [BLOCK_N] row starts
    u_rows = g_rows + inter * stride_qn
    g_ptrs = g_rows[:, None] + tl.arange(0, 16)[None, :]                       # [BLOCK_N, 16]
    u_ptrs = u_rows[:, None] + tl.arange(0, 16)[None, :]
    gs_ptrs = ws + expert * stride_se + cols.to(tl.int64) * stride_sn          # [BLOCK_N]
    us_ptrs = gs_ptrs + inter * stride_sn
    groups = hidden // 32
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PREFETCH:
        # Step k + 1's weight bytes and scales are loaded before step k's are decoded.
        gb, gsc = _wide_load(g_rows, gs_ptrs, 0, groups, col_ok, G)
        ub, usc = _wide_load(u_rows, us_ptrs, 0, groups, col_ok, G)
    for k in range(tl.cdiv(groups, G)):
        if WIDE:
            ka = k * (32 * G) + tl.arange(0, 32 * G)
            a = tl.load(x + token[:, None] * stride_x + ka[None, :], mask=valid[:, None] & (ka < hidden)[None, :],
                        other=0.0)                                            # [BLOCK_M, 32G]
            if PREFETCH:
                gb_next, gsc_next = _wide_load(g_rows, gs_ptrs, k + 1, groups, col_ok, G)
                ub_next, usc_next = _wide_load(u_rows, us_ptrs, k + 1, groups, col_ok, G)
            else:
                gb, gsc = _wide_load(g_rows, gs_ptrs, k, groups, col_ok, G)
                ub, usc = _wide_load(u_rows, us_ptrs, k, groups, col_ok, G)
            gate = _wide_apply(gate, a, gb, gsc, BLOCK_N, G, S_E8M0, SCALE_W, SPLIT, ASM, DOT_PRECISION, BF16_BITS)
            up = _wide_apply(up, a, ub, usc, BLOCK_N, G, S_E8M0, SCALE_W, SPLIT, ASM, DOT_PRECISION, BF16_BITS)
            if PREFETCH:
                gb, gsc, ub, usc = gb_next, gsc_next, ub_next, usc_next
        else:
            for g in tl.static_range(G):
                q = k * G + g                                                 # the 32-input group
                ok = tl.full([1], q, tl.int32) < groups      # ragged tail; a tensor, as the interpreter masks
                a = tl.load(a_ptrs + q * 32, mask=valid[:, None] & ok, other=0.0)
                sa = tl.load(sa_ptrs + q * 32 // ACT_GROUP, mask=valid & ok, other=0.0) if FP8 else 0.0
                gate = _group_dot(gate, a, sa, g_ptrs + q * 16, gs_ptrs + q, col_ok, ok,
                                  S_E8M0, FP8, SCALE_W, ASM, DOT_PRECISION)
                up = _group_dot(up, a, sa, u_ptrs + q * 16, us_ptrs + q, col_ok, ok,
                                S_E8M0, FP8, SCALE_W, ASM, DOT_PRECISION)
    _store_swiglu(gate, up, limit, act_ptr, pair, stride_act, cols, valid, col_ok, HAS_LIMIT)


@triton.jit
def _fp4g_down_kernel(
    act, act_s, wq, ws, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter, num_pid_m,
    stride_act, stride_as, stride_qe, stride_qn, stride_se, stride_sn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, ACT_GROUP: tl.constexpr,
    GROUP_M: tl.constexpr, S_E8M0: tl.constexpr, FP8: tl.constexpr, SCALE_W: tl.constexpr, WIDE: tl.constexpr,
    SPLIT: tl.constexpr, ASM: tl.constexpr, DOT_PRECISION: tl.constexpr, BF16_BITS: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_pid_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                            # [BLOCK_N] of H
    col_ok = cols < hidden
    out_rows = pair.to(tl.int64)
    a_ptrs = act + out_rows[:, None] * stride_act + tl.arange(0, 32)[None, :]    # [BLOCK_M, 32]
    sa_ptrs = act_s + out_rows * stride_as
    w_rows = wq + expert * stride_qe + cols.to(tl.int64) * stride_qn          # [BLOCK_N] row starts
    w_ptrs = w_rows[:, None] + tl.arange(0, 16)[None, :]                       # [BLOCK_N, 16]
    s_ptrs = ws + expert * stride_se + cols.to(tl.int64) * stride_sn
    groups = inter // 32
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PREFETCH:
        wb, wsc = _wide_load(w_rows, s_ptrs, 0, groups, col_ok, G)
    for k in range(tl.cdiv(groups, G)):
        if WIDE:
            ka = k * (32 * G) + tl.arange(0, 32 * G)
            a = tl.load(act + out_rows[:, None] * stride_act + ka[None, :],
                        mask=valid[:, None] & (ka < inter)[None, :], other=0.0)   # [BLOCK_M, 32G]
            if PREFETCH:
                wb_next, wsc_next = _wide_load(w_rows, s_ptrs, k + 1, groups, col_ok, G)
            else:
                wb, wsc = _wide_load(w_rows, s_ptrs, k, groups, col_ok, G)
            acc = _wide_apply(acc, a, wb, wsc, BLOCK_N, G, S_E8M0, SCALE_W, SPLIT, ASM, DOT_PRECISION, BF16_BITS)
            if PREFETCH:
                wb, wsc = wb_next, wsc_next
        else:
            for g in tl.static_range(G):
                q = k * G + g
                ok = tl.full([1], q, tl.int32) < groups
                a = tl.load(a_ptrs + q * 32, mask=valid[:, None] & ok, other=0.0)
                sa = tl.load(sa_ptrs + q * 32 // ACT_GROUP, mask=valid & ok, other=0.0) if FP8 else 0.0
                acc = _group_dot(acc, a, sa, w_ptrs + q * 16, s_ptrs + q, col_ok, ok,
                                 S_E8M0, FP8, SCALE_W, ASM, DOT_PRECISION)
    _store_weighted(acc, weights_ptr, out_ptr, out_rows, stride_out, cols, valid, col_ok)


def fp4_pick_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                    elem_bytes: int = 2) -> MoEConfig:
    """:func:`fused_moe.pick_config`'s tiles by pairs per expert, with pointer loads (the packed
    bytes are dequantised in registers, so no TMA tiles and act stays by pair), K steps of at
    least 32 inputs (each MMA then reduces over 16), and for the 128-row prefill blocks half-width
    N-tiles: the dequantised tiles take registers, and the full ones spilled (sm_90 compile,
    ``scripts/probes/sm90_resources.py``)."""
    return fp4_tiles(pick_config(num_tokens, top_k, num_experts, hidden, inter, elem_bytes))


def fp4_tiles(cfg: MoEConfig) -> MoEConfig:
    """A :class:`fused_moe.MoEConfig` made fit for the FP4 kernels (see :func:`fp4_pick_config`)."""
    if cfg.block_m >= 128:
        cfg = dataclasses.replace(cfg, block_n1=min(cfg.block_n1, 64), block_n2=min(cfg.block_n2, 128))
    return dataclasses.replace(cfg, tma=False, sorted_act=False, block_k1=max(32, cfg.block_k1),
                               block_k2=max(32, cfg.block_k2), num_stages=min(cfg.num_stages, 3))


PATHS = ("dequant", "group")
DOTS = ("bf16", "fp8")
SCALES = ("dot", "weight", "weight32")


@dataclasses.dataclass(frozen=True)
class FP4Kernel:
    """Which FP4 kernels run (the tiles are a :class:`fused_moe.MoEConfig`; the field defaults are
    the plainest group-path kernel, :func:`fp4_pick_kernel` names the one :func:`fp4_moe` runs).

    path: ``"group"`` (codes turned into e4m3 bytes by integer ops, one scale load a column and
    32-input group) or ``"dequant"`` (each weight decoded to float32 and scaled before the dot).
    The rest is the group path's: ``dot`` ``"bf16"`` (dots in the activations' dtype, bf16 in
    serving) or ``"fp8"`` (activations quantised to e4m3 per token and ``act_group`` inputs, FP8
    dots); ``groups`` 32-input groups per K step (unrolled); ``asm``: the nibble decode by inline
    PTX, 4 bytes a register (CUDA only; the CPU interpreter uses the plain byte ops regardless);
    ``scale`` (bf16 dots) ``"dot"``: each group's dot result times the column's scale (BLOCK_M x
    BLOCK_N multiplies a group, cheap for decode's 16-row blocks), or ``"weight"``: the decoded
    [BLOCK_N, 32] tile times the scales before the dot (BLOCK_N x 32 multiplies a group, cheaper
    for prefill's 128-row blocks; the MMA accumulates in place), or ``"weight32"``: the same with
    the product in float32, rounded to a's dtype (``"weight"`` multiplies in bf16 where that is
    exact: power-of-two scales and bf16 activations). FP8 dots always scale after.
    ``wide`` (with ``scale="weight"`` or ``"weight32"``): each K step's G groups as one [BLOCK_N,
    16G] byte load and one dot over 32G inputs, instead of a load and a dot a group; ``split`` (with ``wide``): the
    low and high nibbles left apart, times the activations' even and odd inputs in two dots.
    ``decode`` (with ``wide``): ``"e4m3"`` (codes to e4m3 bytes, then to the activations' dtype) or
    ``"bf16"`` (codes straight to bf16 bits, the 2^126 that puts them in range folded into the
    scale; UE8M0 scales of at most 2^1 and bf16 activations only). ``prefetch`` (with ``wide``):
    each K step's weight bytes and scales loaded one step ahead, before the previous step's are
    decoded (a register double buffer, in flight across the decode and the dots).
    """

    path: str = "group"
    dot: str = "bf16"
    groups: int = 2
    act_group: int = 32
    asm: bool = True
    scale: str = "dot"
    wide: bool = False
    split: bool = False
    decode: str = "e4m3"
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"FP4Kernel: path={self.path!r} is not one of {PATHS}")
        if self.dot not in DOTS:
            raise ValueError(f"FP4Kernel: dot={self.dot!r} is not one of {DOTS}")
        if self.groups not in (1, 2, 4, 8):
            raise ValueError(f"FP4Kernel: groups={self.groups} must be 1, 2, 4 or 8")
        if self.scale not in SCALES:
            raise ValueError(f"FP4Kernel: scale={self.scale!r} is not one of {SCALES}")
        if self.wide and (self.dot != "bf16" or self.scale == "dot"):
            raise ValueError("FP4Kernel: wide=True (one dot a K step) needs dot='bf16' and scale='weight' or "
                             "'weight32'")
        if self.split and not self.wide:
            raise ValueError("FP4Kernel: split=True (even and odd inputs as two dots) needs wide=True")
        if self.decode not in ("e4m3", "bf16"):
            raise ValueError(f"FP4Kernel: decode={self.decode!r} is not 'e4m3' or 'bf16'")
        if self.decode == "bf16" and not self.wide:
            raise ValueError("FP4Kernel: decode='bf16' (codes straight to bf16 bits) needs wide=True")
        if self.prefetch and not self.wide:
            raise ValueError("FP4Kernel: prefetch=True (the next K step's bytes loaded a step ahead) needs wide=True")
        if self.act_group not in (32, 64, 128):
            raise ValueError(f"FP4Kernel: act_group={self.act_group} must be 32, 64 or 128")


def fp4_pick_kernel(cfg: MoEConfig | None = None, bf16_bits: bool = False) -> FP4Kernel:
    """The group path with bf16 dots, scaled weight tiles and wide, split K steps: four groups a
    step for decode's blocks (``cfg.block_m`` < 128, or no config), two for prefill's 128-row
    blocks; for decode's blocks with ``bf16_bits`` (UE8M0 scales of at most 2^1, bf16
    activations) the codes decoded straight to bf16. bf16 dots keep the reference's accuracy
    (FP8 dots add the activations' e4m3 rounding); both decodes give the same bf16 weights, so
    the same bits.

    Measured (H100, V4-Flash widths, UE8M0 scales, CUDA-graph replays with L2 flushed,
    ``scripts/probes/fp4_moe_variants.py``): at T = 1 / 16 / 64 tokens the e4m3 decode takes 80.3 /
    732 / 1,670 us and the bf16 one 73.5 / 629 / 1,429 us (1.09-1.17x), against 383 / 3,938 /
    8,923 us for the dequant path; two groups a step 94 / 826 / 1,851 us (bf16 decode: 86 / 741 /
    1,671), scales after the dot 107-119 / 1,067-1,125 us, FP8 dots 108-110 / 1,069-1,099 us, the
    nibble decode without inline PTX 121 / 1,227 us; two variants tried and removed as slower
    (``1d5e1ae``, docs/BENCHMARKS.md): Triton's microscaled dot (``tl.dot_scaled``) 84 / 828 /
    1,903 us, tiles transposed (the weights as the MMA's register operand, N-tiles of 64) 122 /
    887 / 1,985 us. In the sm_90 SASS of the K loops
    (``scripts/probes/fp4_moe_sass.py``) the e4m3 decode spends about 6-7 instructions a weight
    against 26-30 for the dequant path; two groups a step read 32 contiguous bytes a weight row,
    a whole sector. The prefill tiles (two groups) are unmeasured."""
    decode = cfg is None or cfg.block_m < 128
    groups = 4 if decode else 2
    return FP4Kernel(groups=groups, scale="weight", wide=True, split=True,
                     decode="bf16" if decode and bf16_bits else "e4m3")


def _check_fp4(q: torch.Tensor, s: torch.Tensor, e: int, n: int, k: int, name: str) -> None:
    if q.dtype != torch.uint8 or tuple(q.shape) != (e, n, k // 2) or q.stride(2) != 1:
        raise ValueError(f"fp4_moe: {name} must be uint8 [E={e}, {n}, {k // 2}] (two e2m1 codes a byte) with "
                         f"unit last stride, got {q.dtype} shape {tuple(q.shape)}")
    if tuple(s.shape) != (e, n, k // GROUP) or s.stride(2) != 1 or s.dtype not in (torch.float32, torch.uint8):
        raise ValueError(f"fp4_moe: {name} scales must be float32 or UE8M0 bytes (uint8) [E={e}, {n}, "
                         f"{k // GROUP}] with unit last stride, got {s.dtype} shape {tuple(s.shape)}")


def _dequant_path(x, gate_up_q, gate_up_s, down_q, down_s, topk_weights, act, out, sorted_pairs, block_expert,
                  num_padded, cfg: MoEConfig, k: int, swiglu_limit: float, s_e8m0: bool, precision: str) -> None:
    pairs, h = out.shape
    i = act.shape[1]
    num_pid_m = block_expert.shape[0]
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


def _group_path(x, gate_up_q, gate_up_s, down_q, down_s, topk_weights, act, out, sorted_pairs, block_expert,
                num_padded, cfg: MoEConfig, kern: FP4Kernel, k: int, swiglu_limit: float, s_e8m0: bool,
                precision: str) -> None:
    pairs, h = out.shape
    i = act.shape[1]
    num_pid_m = block_expert.shape[0]
    fp8 = kern.dot == "fp8"
    asm = kern.asm and x.device.type == "cuda"
    bits = kern.decode == "bf16"
    # Scaled weight tiles multiply in bf16 only where that is exact: power-of-two scales (bf16 has
    # float32's exponent range; fp16 has not).
    scale_w = (0 if kern.scale == "dot" else 2 if kern.scale == "weight" and s_e8m0 and x.dtype == torch.bfloat16
               else 1)
    if fp8:
        # One e4m3 copy of x for all its K experts; power-of-two scales beside UE8M0 weights (as
        # DeepSeek's act quant with scale_fmt), so their products with the weight scales are exact.
        xa, xs = fp8_act_quant(x, kern.act_group, s_e8m0)
    else:
        xa, xs = x, x                                                     # xs unused
    _fp4g_gate_up_kernel[(num_pid_m * triton.cdiv(i, cfg.block_n1),)](
        xa, xs, gate_up_q, gate_up_s, act, sorted_pairs, block_expert, num_padded,
        pairs, h, i, num_pid_m, float(swiglu_limit),
        xa.stride(0), xs.stride(0), gate_up_q.stride(0), gate_up_q.stride(1), gate_up_s.stride(0),
        gate_up_s.stride(1), act.stride(0),
        TOP_K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, G=kern.groups, ACT_GROUP=kern.act_group,
        GROUP_M=cfg.group_m, HAS_LIMIT=swiglu_limit > 0, S_E8M0=s_e8m0, FP8=fp8, SCALE_W=scale_w, WIDE=kern.wide,
        SPLIT=kern.split, ASM=asm, DOT_PRECISION=precision, BF16_BITS=bits, PREFETCH=kern.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.flags(x.device))
    if fp8:
        aa, as_ = fp8_act_quant(act, kern.act_group, s_e8m0)
    else:
        aa, as_ = act, act
    _fp4g_down_kernel[(num_pid_m * triton.cdiv(h, cfg.block_n2),)](
        aa, as_, down_q, down_s, out, topk_weights.contiguous(), sorted_pairs, block_expert, num_padded,
        pairs, h, i, num_pid_m,
        aa.stride(0), as_.stride(0), down_q.stride(0), down_q.stride(1), down_s.stride(0), down_s.stride(1),
        out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, G=kern.groups, ACT_GROUP=kern.act_group, GROUP_M=cfg.group_m,
        S_E8M0=s_e8m0, FP8=fp8, SCALE_W=scale_w, WIDE=kern.wide, SPLIT=kern.split, ASM=asm,
        DOT_PRECISION=precision, BF16_BITS=bits, PREFETCH=kern.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.flags(x.device))


def fp4_moe(x: torch.Tensor, gate_up_q: torch.Tensor, gate_up_s: torch.Tensor, down_q: torch.Tensor,
            down_s: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            swiglu_limit: float = 0.0, config: MoEConfig | None = None, invariant: bool = False,
            kernel: FP4Kernel | None = None, small_scales: bool = False) -> torch.Tensor:
    """``sum_k w[t,k] * down_e(silu(min(g, L)) * clamp(u, -L, L))``, (g, u) = gate_up_e(x_t), with the
    experts' weights in FP4 (see :func:`reference.fp4_moe_experts`).

    x: [T, H] (bf16/fp16/float32); gate_up_q: [E, 2I, H/2] uint8 with gate_up_s [E, 2I, H/32];
    down_q: [E, H, I/2] with down_s [E, H, I/32] (scales float32 or UE8M0 bytes, both projections
    alike); topk_weights [T, K] float32; topk_ids [T, K] integer -> [T, H] in x's dtype. A slot whose
    id is outside [0, E) contributes nothing. ``config`` overrides :func:`fp4_pick_config`;
    ``invariant`` (batch-invariant mode) takes :func:`fused_moe.invariant_config`'s tiles for every T
    (made fit by :func:`fp4_tiles`); ``kernel`` overrides :func:`fp4_pick_kernel` (with ``dot="fp8"``
    the result is :func:`reference.fp4_moe_experts_fp8`'s); ``small_scales``: the caller knows every
    UE8M0 scale is at most 2^1 (byte 128), so the default kernel may decode codes straight to bf16
    (a larger scale would overflow there).
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
    cfg = config or (fp4_tiles(invariant_config(h, i, x.element_size())) if invariant
                     else fp4_pick_config(t, k, e, h, i, x.element_size()))
    if cfg.tma or cfg.sorted_act:
        raise ValueError("fp4_moe: the FP4 kernels load by pointer; configs with tma or sorted_act are not supported")
    bits = small_scales and gate_up_s.dtype == torch.uint8 and x.dtype == torch.bfloat16
    kern = kernel or fp4_pick_kernel(cfg, bits)
    if kern.path == "group" and kern.dot == "fp8" and (h % kern.act_group or i % kern.act_group):
        raise ValueError(f"fp4_moe: FP8 dots quantise activations per {kern.act_group} inputs, which must divide "
                         f"H={h} and I={i}")
    if kern.decode == "bf16" and (gate_up_s.dtype != torch.uint8 or x.dtype != torch.bfloat16):
        raise ValueError(f"fp4_moe: decode='bf16' takes UE8M0 (uint8) scales and bf16 activations, got "
                         f"{gate_up_s.dtype} scales and {x.dtype} activations")
    if kern.path != "dequant" and cfg.block_m < 16:
        raise ValueError(f"fp4_moe: block_m={cfg.block_m} is below the MMA's 16 rows")
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    s_e8m0 = gate_up_s.dtype == torch.uint8
    out = torch.empty(pairs, h, dtype=x.dtype, device=x.device)             # [P, H]
    sorted_pairs, block_expert, num_padded = moe_align(topk_ids.contiguous(), e, cfg.block_m, out)
    act = torch.empty(pairs, i, dtype=x.dtype, device=x.device)             # [P, I]
    if kern.path == "dequant":
        _dequant_path(x, gate_up_q, gate_up_s, down_q, down_s, topk_weights, act, out, sorted_pairs, block_expert,
                      num_padded, cfg, k, swiglu_limit, s_e8m0, precision)
    else:
        _group_path(x, gate_up_q, gate_up_s, down_q, down_s, topk_weights, act, out, sorted_pairs, block_expert,
                    num_padded, cfg, kern, k, swiglu_limit, s_e8m0, precision)
    return sum_slots(out, t, k)
