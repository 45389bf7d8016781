"""The FP8 block-scaled GEMM (per-token-group activation quant + block-scaled e4m3 GEMM) against
reference.fp8_act_quant / fp8_block_gemm / fp8_linear on random data, with both weight-scale
layouts: 128 x 128 float32 (DeepSeek-V4) and 32 x 32 UE8M0 bytes (V4.1).

Accuracy stated in kernels/fp8_gemm.py: against the reference on the same quantised operands,
float32 accumulation order only; against the dequantised-weight float32 product, the activations'
e4m3 rounding (relative Frobenius error about 0.025, allowed 0.05).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.fp8_gemm import fp8_act_quant, fp8_block_gemm, fp8_linear, pick_tiles
from deepinfer.models.quant import dequant_fp8_block, quant_fp8_block

ON_CUDA = torch.cuda.is_available()
FORMATS = [((128, 128), "float32"), ((32, 32), "ue8m0")]


def make_weight(n: int, k: int, block, scale_format, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    q, s = quant_fp8_block(w, block, scale_format)
    return q.to(device), s.to(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("group", [32, 128])
def test_act_quant_matches_reference(group, pow2, device):
    gen = torch.Generator().manual_seed(group)
    x = (torch.randn(7, 256, generator=gen) * torch.logspace(-3, 2, 256)).to(device)
    x[0, :group] = 0.0                                                   # an all-zero group
    q, s = fp8_act_quant(x, group, pow2)
    rq, rs = reference.fp8_act_quant(x, group, pow2)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (7, 256 // group)
    torch.testing.assert_close(s, rs, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    if pow2:
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    # Round trip: e4m3 keeps 3 mantissa bits (half-ulp relative error 2^-4), subnormals 2^-10 of the scale.
    back = q.float() * s.repeat_interleave(group, dim=1)
    bound = torch.maximum(x.abs() * 2 ** -4, s.repeat_interleave(group, dim=1) * 2 ** -10)
    assert ((back - x).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("block,scale_format", FORMATS)
@pytest.mark.parametrize("m,n", [(1, 96), (5, 200), (70, 64)])
def test_fp8_block_gemm_matches_reference(m, n, block, scale_format, device):
    k = 256
    w, ws = make_weight(n, k, block, scale_format, device, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device)
    xq, xs = reference.fp8_act_quant(x, 128)
    for dtype in (torch.float32, torch.float16):
        out = fp8_block_gemm(xq, xs, w, ws, block, dtype)
        ref = reference.fp8_block_gemm(xq, xs, w, ws, block, dtype)
        assert out.dtype == dtype and out.shape == (m, n)
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-3, "atol": 1e-3}
        torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("block,scale_format", FORMATS)
def test_fp8_linear_accuracy_against_dequantised_weights(block, scale_format, device):
    """The whole linear (activations quantised on the fly) against the reference and against x @ W^T
    with the dequantised float32 weight: within the activations' e4m3 rounding."""
    n, k = 192, 512
    w, ws = make_weight(n, k, block, scale_format, device, seed=1)
    x = torch.randn(3, 4, k, generator=torch.Generator().manual_seed(2)).to(device)
    out = fp8_linear(x, w, ws, block)
    torch.testing.assert_close(out, reference.fp8_linear(x, w, ws, block), rtol=1e-5, atol=1e-5)
    exact = x @ dequant_fp8_block(w, ws, block).t()
    assert out.shape == (3, 4, n)
    assert 0.005 < rel_err(out, exact) < 0.05


def test_fp8_gemm_rejects_bad_operands(device):
    w, ws = make_weight(64, 128, (128, 128), "float32", device)
    xq, xs = reference.fp8_act_quant(torch.randn(2, 128).to(device), 128)
    with pytest.raises(ValueError, match="scales of shape"):
        fp8_block_gemm(xq, xs, w, ws[:, :0], (128, 128), torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_block_gemm(xq, xs, w.float(), ws, (128, 128), torch.float32)
    with pytest.raises(ValueError, match="group=48"):
        fp8_act_quant(torch.randn(2, 96).to(device), 48)


def test_pick_tiles_decode_and_prefill():
    assert pick_tiles(1, 4096)[:2] == (16, 32) and pick_tiles(64, 16384)[:2] == (64, 64)
    assert pick_tiles(4096, 4096)[:2] == (128, 128)
    assert pick_tiles(3, 20)[1] == 32                                    # tiles never exceed the problem much


# -- GPU, DeepSeek-V4-Flash widths ----------------------------------------------------------------

# (N, K) of V4-Flash's FP8 projections: wq_a, wq_b, wkv, wo_b, shared expert w1/w3 and w2.
V4_SHAPES = [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (2048, 4096), (4096, 2048)]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("block,scale_format", FORMATS)
@pytest.mark.parametrize("m", [1, 16, 64, 4096])
@pytest.mark.parametrize("nk", V4_SHAPES)
def test_fp8_linear_gpu_v4_sizes(nk, m, block, scale_format):
    n, k = nk
    w, ws = make_weight(n, k, block, scale_format, "cuda", seed=n + k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = fp8_linear(x, w, ws, block)
    xq, xs = reference.fp8_act_quant(x, 128)
    ref = reference.fp8_block_gemm(xq, xs, w, ws, block, torch.float32)
    assert not out.isnan().any()
    assert rel_err(out, ref) < 1e-2                                      # bf16 output rounding
    exact = x.float() @ dequant_fp8_block(w, ws, block).t()
    assert rel_err(out, exact) < 0.05
