"""The Triton clamped SwiGLU against reference.clamped_swiglu, on column slices of one
fused projection output (as the shared expert passes them)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.activation import clamped_swiglu


@pytest.mark.parametrize("t,width,limit", [(1, 64, 10.0), (5, 1000, 2.5), (3, 2048, 0.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_matches_reference(t, width, limit, dtype, device):
    gen = torch.Generator().manual_seed(width + t)
    fused = (torch.randn(t, 2 * width, generator=gen) * 6).to(dtype).to(device)   # values past the limit
    gate, up = fused[:, :width], fused[:, width:]
    out = clamped_swiglu(gate, up, limit)
    ref = reference.clamped_swiglu(gate.float(), up.float(), limit)
    assert out.dtype == dtype and out.shape == (t, width)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(out.float(), ref, **tol)
    if limit > 0:       # the clamp bites: the unclamped product is far off somewhere
        assert not torch.allclose(out.float(), reference.clamped_swiglu(gate.float(), up.float(), 0.0), **tol)


def test_clamped_swiglu_rejects_mismatched_shapes(device):
    with pytest.raises(ValueError, match="gate and up"):
        clamped_swiglu(torch.zeros(2, 4, device=device), torch.zeros(2, 5, device=device), 1.0)


@pytest.mark.parametrize("pow2", [False, True], ids=["float32-scales", "pow2-scales"])
@pytest.mark.parametrize("t,width,group", [(1, 64, 32), (3, 2048, 128), (2, 384, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clamped_swiglu_fp8_output_is_act_quant_of_the_output(t, width, group, pow2, dtype, device):
    """With ``fp8`` the launch also stores its output quantised for the FP8 down projection:
    fp8_act_quant of the output, bit for bit (2048 columns: two programs a row)."""
    from deepinfer.kernels.fp8_gemm import fp8_act_quant

    gen = torch.Generator().manual_seed(width + t)
    fused = (torch.randn(t, 2 * width, generator=gen) * 6).to(dtype).to(device)
    gate, up = fused[:, :width], fused[:, width:]
    out, q, s = clamped_swiglu(gate, up, 7.0, fp8=(group, pow2))
    assert torch.equal(out, clamped_swiglu(gate, up, 7.0))
    ref_q, ref_s = fp8_act_quant(out, group, pow2)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    assert (q.float() != 0).float().mean() > 0.9
    with pytest.raises(ValueError, match="group=96"):
        clamped_swiglu(gate, up, 7.0, fp8=(96, pow2))
