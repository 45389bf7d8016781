"""The Triton RMSNorm kernel against reference.rms_norm on random data."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.rms_norm import rms_norm

# bfloat16: two ulps (the CPU interpreter truncates where the GPU rounds).
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 3e-2, "atol": 1e-2}}


@pytest.mark.parametrize("shape", [(1, 16), (5, 3, 100), (7, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(shape, dtype, device, poison_empty):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    weight = torch.randn(shape[-1], generator=gen).to(dtype).to(device)
    out = rms_norm(x, weight, 1e-6)
    ref = reference.rms_norm(x, weight, 1e-6)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_rms_norm_strided_rows_and_promoted_weight(device, poison_empty):
    """Rows with a stride (a slice of a wider buffer) and a float32 weight on bfloat16 x:
    the reference rounds the normalised row to bfloat16, then returns the product in float32."""
    gen = torch.Generator().manual_seed(1)
    buf = torch.randn(6, 80, generator=gen).to(torch.bfloat16).to(device)
    x = buf[:, 8:72]                                                     # [6, 64], row stride 80
    weight = torch.randn(64, generator=gen).to(device)
    out = rms_norm(x, weight, 1e-5)
    ref = reference.rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_weight_in_float32(dtype, device, poison_empty):
    """DeepSeek-V4's norm (round_first=False): float32 weight times the float32 normalised row,
    rounded once to x's dtype, which differs from rounding the row first."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(9, 96, generator=gen) * 3).to(dtype).to(device)
    weight = (1 + torch.randn(96, generator=gen) / 3).to(device)           # float32, as V4 keeps it
    out = rms_norm(x, weight, 1e-6, round_first=False)
    ref = reference.rms_norm(x, weight, 1e-6, round_first=False)
    assert out.dtype == ref.dtype == dtype
    torch.testing.assert_close(out, ref, **TOL[dtype])
    xf = x.float()
    expected = (weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).to(dtype)
    torch.testing.assert_close(ref, expected, rtol=0, atol=0)


def test_rms_norm_rejects_a_mis_shaped_weight(device):
    with pytest.raises(ValueError, match="weight has shape"):
        rms_norm(torch.randn(2, 8, device=device), torch.randn(4, device=device), 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(8192, 4096), (333, 7168), (4096, 128)])
def test_rms_norm_gpu_sizes(shape, poison_empty):
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * 3
    weight = torch.randn(shape[-1], device="cuda", dtype=torch.bfloat16)
    out = rms_norm(x, weight, 1e-6)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("pow2", [False, True], ids=["float32-scales", "pow2-scales"])
@pytest.mark.parametrize("shape,group", [((3, 256), 128), ((2, 3, 96), 32), ((1, 1024), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fp8_output_is_act_quant_of_the_output(shape, group, pow2, dtype, device, poison_empty):
    """With ``fp8`` the launch also stores the output quantised for an FP8 linear: the same
    codes and scales as fp8_act_quant of the output it returns, bit for bit."""
    from deepinfer.kernels.fp8_gemm import fp8_act_quant

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)
    weight = torch.randn(shape[-1], generator=gen).to(dtype).to(device)
    out, q, s = rms_norm(x, weight, 1e-6, round_first=False, fp8=(group, pow2))
    assert torch.equal(out, rms_norm(x, weight, 1e-6, round_first=False))
    ref_q, ref_s = fp8_act_quant(out.reshape(-1, shape[-1]), group, pow2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == ref_q.shape and s.shape == ref_s.shape
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    assert (q.float() != 0).float().mean() > 0.9                      # random data: codes, not zeros
    with pytest.raises(ValueError, match="group=48"):
        rms_norm(x, weight, 1e-6, fp8=(48, pow2))
