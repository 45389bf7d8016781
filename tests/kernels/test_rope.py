"""The Triton rotate-half RoPE kernel against reference.apply_rope on random data."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.rope import apply_rope, apply_rope_qk_

# bfloat16: three roundings per output, each up to one ulp off where the CPU
# interpreter truncates instead of rounding.
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 3e-2, "atol": 2e-2}}


def cos_sin(t: int, half: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(t, half, generator=gen) * 100                    # [T, D/2]
    return angles.cos().to(device), angles.sin().to(device)


@pytest.mark.parametrize("t,hq,hk,d", [(1, 1, 1, 16), (5, 6, 2, 24), (9, 8, 8, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_matches_reference(t, hq, hk, d, dtype, device, poison_empty):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, hq, d, generator=gen).to(dtype).to(device)
    cos, sin = cos_sin(t, d // 2, gen, device)
    before = x.clone()
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out, reference.apply_rope(x, cos, sin), **TOL[dtype])
    assert torch.equal(x, before)                                        # the copy leaves x alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_qk_in_place_on_a_fused_qkv_buffer(dtype, device):
    """q and k as strided views into one [T, (Hq + 2 Hk) * D] projection output, as a
    fused QKV linear leaves them; v (the rest of the buffer) must stay untouched."""
    gen = torch.Generator().manual_seed(1)
    t, hq, hk, d = 7, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype).to(device)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v_before = qkv[:, (hq + hk) * d:].clone()
    cos, sin = cos_sin(t, d // 2, gen, device)
    q_ref, k_ref = reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)
    apply_rope_qk_(q, k, cos, sin)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])
    assert torch.equal(qkv[:, (hq + hk) * d:], v_before)


def test_apply_rope_rejects_mismatched_cos(device):
    x = torch.randn(3, 2, 16, device=device)
    cos = torch.randn(3, 4, device=device)
    with pytest.raises(ValueError, match="must be"):
        apply_rope(x, cos, cos)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,hq,hk,d", [(4096, 32, 8, 128), (64, 128, 128, 64)])
def test_apply_rope_qk_gpu_sizes(t, hq, hk, d):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(t, hq, d, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(t, hk, d, generator=gen).to("cuda", torch.bfloat16)
    cos, sin = cos_sin(t, d // 2, gen, "cuda")
    q_ref, k_ref = reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)
    apply_rope_qk_(q, k, cos, sin)
    torch.testing.assert_close(q, q_ref, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(k, k_ref, rtol=1.6e-2, atol=1e-2)
