"""Float32-accurate products of a bf16 tile with a float32 tile on bf16 tensor cores
(used by ``hyper_connection.py`` and ``router.py`` at prefill sizes).

bf16 x bf16 products are exact in float32, and a float32 value splits exactly into three
bf16 parts (``hi = bf16(w)``, ``lo = bf16(w - hi)``, ``lo2 = bf16(w - hi - lo)``: 3 x 8
significand bits cover float32's 24). So ``x @ w`` for bf16 x is three bf16 dots into one
float32 accumulator, as accurate as tf32x3 (which drops w's last bits and the lo x lo term)
at half its tensor-core work, and with no conversion or splitting of x. The split is made in
registers per K step from w's float32 tile: nothing cached, nothing to go stale when the
weights are reloaded.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_bf16(x, w, acc, BF16_DOT: tl.constexpr):
    """acc + x @ w for bfloat16 x [M, K] and w [K, N]: exact products, float32 sums. Off the
    GPU (the interpreter multiplies bfloat16 tiles as raw integers) the same products as
    float32 dots."""
    if BF16_DOT:
        return tl.dot(x, w, acc)
    return tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def dot_bf16x3(x, w, acc, BF16_DOT: tl.constexpr):
    """acc + x @ w for bfloat16 x [M, K] and float32 w [K, N], w split into three bf16 parts."""
    w_hi = w.to(tl.bfloat16)
    rest = w - w_hi.to(tl.float32)
    w_lo = rest.to(tl.bfloat16)
    w_lo2 = (rest - w_lo.to(tl.float32)).to(tl.bfloat16)
    acc = dot_bf16(x, w_hi, acc, BF16_DOT)
    acc = dot_bf16(x, w_lo, acc, BF16_DOT)
    return dot_bf16(x, w_lo2, acc, BF16_DOT)
