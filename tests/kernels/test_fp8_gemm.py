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
import triton

from deepinfer.kernels import fp8_gemm, launch, reference
from deepinfer.kernels.fp8_gemm import (default_split, fp8_act_quant, fp8_block_gemm, fp8_linear, pick_split,
                                         pick_tiles)
from deepinfer.kernels.launch import tile_counters
from deepinfer.models.quant import dequant_fp8_block, quant_fp8_block

from .conftest import capture

ON_CUDA = torch.cuda.is_available()
# Hopper's FP8 tensor-core MMA keeps about 14 bits of its running sum (DeepSeek-V3 report, 3.3.2), so
# on CUDA a float32 result meets the float32 reference to a few 2^-14 of the sums, not to float32
# rounding (measured on an H100: 2^-12.3 of the largest output at K = 256); the interpreter sums in
# float32.
F32_TOL = 2 ** -11 if ON_CUDA else 1e-5
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
        tol = ({"rtol": F32_TOL, "atol": F32_TOL * ref.abs().max().item()} if dtype == torch.float32
               else {"rtol": 1e-3, "atol": 1e-3})
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


def random_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows spanning five decades across K, with one all-zero group (the 1e-4 amax floor)."""
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-3, 2, k)
    x[0, 128:256] = 0.0
    return x


@pytest.mark.parametrize("block,scale_format", FORMATS)
@pytest.mark.parametrize("m,n,k,split", [(1, 96, 256, 1), (5, 200, 512, 2), (16, 64, 1024, 4)])
def test_fp8_linear_is_quant_then_gemm(m, n, k, split, block, scale_format, device):
    """fp8_linear (16/32-bit activations) equals fp8_act_quant then the GEMM bit for bit, with or
    without split K, and the reference GEMM on the reference's codes."""
    pow2 = scale_format == "ue8m0"
    w, ws = make_weight(n, k, block, scale_format, device, seed=n + k)
    x = random_activations(m, k, seed=m).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        out = fp8_linear(xd, w, ws, block, 128, pow2, split=split)
        assert out.dtype == dtype and out.shape == (m, n)
        xq, xs = fp8_act_quant(xd, 128, pow2)
        assert torch.equal(out, fp8_block_gemm(xq, xs, w, ws, block, dtype, split=split))
        xq, xs = reference.fp8_act_quant(xd, 128, pow2)
        ref = reference.fp8_block_gemm(xq, xs, w, ws, block, dtype)
        tol = F32_TOL if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(out, ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("block,scale_format", FORMATS)
@pytest.mark.parametrize("m,n,k,split", [(1, 96, 256, 1), (5, 200, 512, 2), (16, 64, 1024, 4)])
def test_fp8_linear_quantized_input_and_residual(m, n, k, split, block, scale_format, device):
    """Given x's codes and scales (as a producer kernel stores them), the GEMM equals the plain
    fp8_linear bit for bit; with a residual the product is added to it in the epilogue (float32,
    rounded once), in place, with or without split K, and bad operands are refused."""
    pow2 = scale_format == "ue8m0"
    w, ws = make_weight(n, k, block, scale_format, device, seed=n + k)
    x = random_activations(m, k, seed=m).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        plain = fp8_linear(xd, w, ws, block, 128, pow2, split=split)
        given = fp8_linear(xd, w, ws, block, 128, pow2, split=split, quantized=fp8_act_quant(xd, 128, pow2))
        assert torch.equal(given, plain)
        base = torch.randn(m, n, generator=torch.Generator().manual_seed(n)).to(dtype).to(device)
        residual = base.clone()
        out = fp8_linear(xd, w, ws, block, 128, pow2, split=split, residual=residual)
        assert out is residual
        want = (base.float() + fp8_linear(xd, w, ws, block, 128, pow2, split=split).float())
        tol = F32_TOL if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * want.abs().max().item())
        assert not torch.equal(out, base)
    with pytest.raises(ValueError, match="residual must be"):
        fp8_linear(x, w, ws, block, 128, pow2, residual=torch.zeros(m, n + 1, device=device))
    with pytest.raises(ValueError, match="quantized activations"):
        fp8_linear(x, w, ws, block, 128, pow2, quantized=fp8_act_quant(x[:, :128].contiguous(), 128, pow2))


@pytest.mark.parametrize("block,scale_format", FORMATS)
@pytest.mark.parametrize("m,groups,npg,k,split", [(1, 4, 64, 256, None), (5, 2, 48, 512, 2), (33, 8, 32, 256, 1)])
def test_grouped_linear_matches_reference(m, groups, npg, k, split, block, scale_format, device):
    """A block-diagonal weight (V4's grouped wo_a): x [M, g, K] -> [M, g, N/g], group g's inputs
    times the g-th N/g rows, in one launch; against the reference, against the full product's
    diagonal blocks. 48 rows a group: 16-wide N-tiles."""
    pow2 = scale_format == "ue8m0"
    n = groups * npg                   # 96 rows: a 128-row scale block spans both groups, and past N
    w, ws = make_weight(n, k, block, scale_format, device, seed=n + k)
    x = torch.stack([random_activations(m, k, seed=m + g) for g in range(groups)], dim=1).to(device)
    got = fp8_linear(x, w, ws, block, 128, pow2, split=split, groups=groups)
    assert got.shape == (m, groups, npg)
    ref = reference.fp8_linear(x, w, ws, block, 128, pow2, groups=groups)
    torch.testing.assert_close(got, ref, rtol=F32_TOL, atol=F32_TOL * ref.abs().max().item())
    want = reference.fp8_linear(x.float(), w, ws, block, 128, pow2)                   # every group x every row
    for g in range(groups):
        # Two float32 products of other shapes: cuBLAS may sum them in another order.
        torch.testing.assert_close(ref[:, g], want[:, g, g * npg:(g + 1) * npg], rtol=1e-5,
                                   atol=1e-5 * want.abs().max().item())
    with pytest.raises(ValueError, match="groups=3"):
        fp8_linear(x, w, ws, block, 128, pow2, groups=3)


def test_group_tile_n_keeps_tiles_inside_a_group():
    assert [fp8_gemm.group_tile_n(r) for r in (1024, 64, 48, 16)] == [128, 64, 16, 16]
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_gemm.group_tile_n(40)


@pytest.mark.parametrize("block,scale_format", FORMATS)
@pytest.mark.parametrize("split", [2, 4, 8])
def test_split_k_matches_reference(split, block, scale_format, device):
    m, n, k = 3, 160, 1024
    w, ws = make_weight(n, k, block, scale_format, device, seed=split)
    xq, xs = reference.fp8_act_quant(random_activations(m, k, seed=split).to(device), 128)
    ref = reference.fp8_block_gemm(xq, xs, w, ws, block, torch.float32)
    for _ in range(2):                                   # the tile counters are back at zero after a launch
        out = fp8_block_gemm(xq, xs, w, ws, block, torch.float32, split=split)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert not tile_counters(xq.device, 1).any()


def test_tile_counters_grow_and_keep_the_superseded_set():
    """More tiles than the counters hold: a larger zeroed set; the smaller one stays allocated for
    the CUDA graphs captured with it."""
    dev = torch.device("cpu")
    small = tile_counters(dev, 1)
    big = tile_counters(dev, small.numel() + 1)
    assert big.numel() > small.numel() and not big.any() and tile_counters(dev, 1) is big
    assert any(t is small for t in launch._counters[(dev, 0)])


@pytest.mark.parametrize("block,scale_format", FORMATS)
def test_invariant_mode_rows_are_identical_for_every_batch_size(block, scale_format, device):
    """Batch-invariant mode: one tile shape and one K split for every M, so a row's output does
    not depend on the rows beside it."""
    n, k = 96, 512
    assert pick_split(triton.cdiv(n, 32), k // 128, 132) == 2              # split K is exercised
    w, ws = make_weight(n, k, block, scale_format, device, seed=3)
    x = random_activations(80, k, seed=4).to(device)
    pow2 = scale_format == "ue8m0"
    full = fp8_linear(x, w, ws, block, 128, pow2, invariant=True)
    for m in (1, 7, 16, 33):
        assert torch.equal(fp8_linear(x[:m], w, ws, block, 128, pow2, invariant=True), full[:m])


def test_pick_split_fills_the_sms_only_when_the_tiles_do_not():
    assert pick_split(16, 32, 132) == 8                                  # V4 kv: N = 512, K = 4096
    assert pick_split(32, 32, 132) == 4                                  # V4 q_a: N = 1024
    assert pick_split(128, 32, 132) == 1                                 # N = 4096 fills the GPU
    assert pick_split(16, 32, 132, max_split=2) == 2
    assert pick_split(1, 4, 132) == 2                                    # slices of two groups at least
    assert pick_split(1, 6, 132) == 2 and pick_split(1, 3, 132) == 1     # S divides the groups


def test_default_split_takes_two_waves_up_to_16_rows_and_never_follows_m_when_invariant():
    # V4-Flash o_b (N = 4096 in 32-wide tiles, K = 8192): two slices at one and 16 tokens, none at 64
    assert [default_split(m, 1, 128, 64, 132, False) for m in (1, 16, 64)] == [2, 2, 1]
    assert default_split(1, 1, 32, 32, 132, False) == 8                  # q_a: N = 1024
    assert default_split(1, 1, 512, 8, 132, False) == 1                  # q_b: N = 32768 fills the GPU
    assert {default_split(m, -(-m // 64), 128, 64, 132, True) for m in (1, 16, 64, 4096)} == {1}


def test_linear_and_split_reject_bad_operands(device):
    w, ws = make_weight(64, 256, (128, 128), "float32", device)
    x = torch.randn(2, 256).to(device)
    with pytest.raises(ValueError, match="group=48"):
        fp8_linear(x, w, ws, (128, 128), group=48)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, w.float(), ws, (128, 128))
    with pytest.raises(ValueError, match="scales of shape"):
        fp8_linear(x, w, ws[:, :1], (128, 128))
    with pytest.raises(ValueError, match="K step"):
        fp8_linear(x, w, ws, (128, 128), group=16)
    with pytest.raises(ValueError, match="split=3"):
        fp8_linear(x, w, ws, (128, 128), split=3)
    with pytest.raises(ValueError, match="split=4"):                      # two groups, four slices
        fp8_linear(x, w, ws, (128, 128), split=4)


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


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("block,scale_format", FORMATS)
def test_fp8_linear_gpu_split_k_deterministic_and_batch_invariant(block, scale_format):
    """V4-Flash's kv projection (N = 512, K = 4096, split K at decode): runs, CUDA-graph replays
    and (batch-invariant mode) batch sizes give the same bits."""
    n, k = 512, 4096
    pow2 = scale_format == "ue8m0"
    w, ws = make_weight(n, k, block, scale_format, "cuda", seed=5)
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    x16 = x[:16].clone()

    def linear(**kw):
        return fp8_linear(x16, w, ws, block, 128, pow2, **kw)

    first = linear()
    assert all(torch.equal(linear(), first) for _ in range(5))
    graph, captured = capture(linear)
    for _ in range(3):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, first)
    full = fp8_linear(x, w, ws, block, 128, pow2, invariant=True)
    for m in (1, 5, 16, 33):
        assert torch.equal(fp8_linear(x[:m], w, ws, block, 128, pow2, invariant=True), full[:m])
    xq, xs = reference.fp8_act_quant(x16, 128, pow2)
    assert rel_err(first, reference.fp8_block_gemm(xq, xs, w, ws, block, torch.float32)) < 1e-2
