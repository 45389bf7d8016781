"""Rotate-half (GPT-NeoX) rotary embedding; reference: :func:`reference.apply_rope`.

One program per token rotates all heads of q and, in the same launch, of k:
dims i and i + D/2 form a pair. cos/sin are loaded once per token and shared
by every head. Outputs may alias inputs (in place). Like the reference, the
products and the sum run in x's dtype: each is rounded to it in turn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl


@triton.jit
def _rotate(x_ptr, out_ptr, token, stride_x_token, stride_x_head, stride_out_token, stride_out_head,
            num_heads, half, cos, sin,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]                          # [BLOCK_H, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]                        # [1, BLOCK_HALF]
    mask = (heads < num_heads) & (dims < half)
    src = x_ptr + token * stride_x_token + heads * stride_x_head + dims
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    dtype = x_ptr.dtype.element_ty
    c = cos.to(dtype).to(tl.float32)                                # [1, BLOCK_HALF]
    s = sin.to(dtype).to(tl.float32)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    o1 = (x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)
    o2 = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    dst = out_ptr + token * stride_out_token + heads * stride_out_head + dims
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, o2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, q_out_ptr, k_ptr, k_out_ptr, cos_ptr, sin_ptr,
    stride_q_token, stride_q_head, stride_qo_token, stride_qo_head,
    stride_k_token, stride_k_head, stride_ko_token, stride_ko_head,
    stride_cos, stride_sin,
    num_q_heads, num_k_heads, half,
    HAS_K: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dims < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=dims < half, other=0.0).to(tl.float32)
    _rotate(q_ptr, q_out_ptr, token, stride_q_token, stride_q_head, stride_qo_token, stride_qo_head,
            num_q_heads, half, cos, sin, BLOCK_HQ, BLOCK_HALF)
    if HAS_K:
        _rotate(k_ptr, k_out_ptr, token, stride_k_token, stride_k_head, stride_ko_token,
                stride_ko_head, num_k_heads, half, cos, sin, BLOCK_HK, BLOCK_HALF)


def _check(name: str, x: torch.Tensor, t: int, half: int) -> None:
    if x.dim() != 3 or x.shape[0] != t or x.shape[2] != 2 * half:
        raise ValueError(f"rope: {name} must be [T={t}, H, D={2 * half}], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"rope: {name}'s last dim must be contiguous")


def _launch(q: torch.Tensor, q_out: torch.Tensor, k: torch.Tensor | None, k_out: torch.Tensor | None,
            cos: torch.Tensor, sin: torch.Tensor) -> None:
    t, half = cos.shape
    if sin.shape != cos.shape or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"rope: cos and sin must both be [T, D/2] with a contiguous last dim, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")
    for name, x in (("q", q), ("q_out", q_out), ("k", k), ("k_out", k_out)):
        if x is not None:
            _check(name, x, t, half)
    if t == 0:
        return
    kk = k if k is not None else q       # placeholders, never read when HAS_K is false
    ko = k_out if k_out is not None else q_out
    # Tile config: one program per token holding every head's half-rows
    # ([H, D/2] per tensor); 4 warps cover up to 32 x 64 pairs in one pass.
    _rope_kernel[(t,)](
        q, q_out, kk, ko, cos, sin,
        q.stride(0), q.stride(1), q_out.stride(0), q_out.stride(1),
        kk.stride(0), kk.stride(1), ko.stride(0), ko.stride(1),
        cos.stride(0), sin.stride(0),
        q.shape[1], kk.shape[1], half,
        HAS_K=k is not None,
        BLOCK_HQ=triton.next_power_of_2(q.shape[1]), BLOCK_HK=triton.next_power_of_2(kk.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=4, **pdl.flags(q.device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotated copy of x. x: [T, H, D]; cos, sin: [T, D/2] float32 -> [T, H, D]."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, out, None, None, cos, sin)
    return out


def apply_rope_qk_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place, in one launch; cos, sin: [T, D/2] float32."""
    _launch(q, q, k, k, cos, sin)
