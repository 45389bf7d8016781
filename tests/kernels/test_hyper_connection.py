"""The Triton hyper-connection kernels (mHC pre / post / head) against reference.hc_*."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import hyper_connection as hc
from deepinfer.kernels import reference
from deepinfer.kernels.launch import tile_counters
from deepinfer.kernels.rms_norm import rms_norm

# Mixing weights are float32 either way; the collapsed/expanded streams come back in the
# streams' dtype, where bfloat16 gets two ulps (the CPU interpreter truncates where the GPU rounds).
# float32: the projection sums n*D products in another order, so the mixing weights differ from
# the reference's by a few ulps, times streams of magnitude ~8.
TOL = {torch.float32: {"rtol": 1e-5, "atol": 5e-5}, torch.bfloat16: {"rtol": 3e-2, "atol": 1e-2}}
MIX_TOL = {"rtol": 1e-5, "atol": 2e-6}


def weights(n: int, d: int, rows: int, gen: torch.Generator, device) -> tuple[torch.Tensor, ...]:
    """fn [rows, n*D], base [rows], scale [3 or 1]: random, at magnitudes that keep the mixes
    O(1) for any n*D (the sigmoids and the softmax unsaturated, so the mixings differ from
    token to token)."""
    fn = (torch.randn(rows, n * d, generator=gen) * 4 / (n * d) ** 0.5).to(device)
    base = torch.randn(rows, generator=gen).to(device)
    scale = (torch.rand(3 if rows > n else 1, generator=gen) + 0.5).to(device)
    return fn, base, scale


def streams_of(t: int, n: int, d: int, dtype: torch.dtype, gen: torch.Generator, device) -> torch.Tensor:
    return (torch.randn(t, n, d, generator=gen) * 2).to(dtype).to(device)


@pytest.mark.parametrize("t,n,d,splits", [(1, 4, 64, None), (5, 4, 64, 3), (7, 3, 64, 2), (40, 4, 64, 5),
                                          (16, 4, 1024, 40), (40, 4, 512, 32), (300, 4, 64, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_matches_reference(t, n, d, splits, dtype, device, poison_empty):
    """T = 1: one launch (the finishing program collapses); more tokens: the separate
    collapse launch; T=40: several token blocks. 3 and 5 splits leave a short last split; n=3 pads the streams
    to a power of two inside the kernel. 32 splits take several loads to reduce. T=300: the large-T
    configs (bf16 streams: fn split into three bf16 parts)."""
    gen = torch.Generator().manual_seed(t * 10 + n)
    s = streams_of(t, n, d, dtype, gen, device)
    fn, base, scale = weights(n, d, (2 + n) * n, gen, device)
    x, post, comb = hc.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6, num_splits=splits)
    rx, rpost, rcomb = reference.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6)
    assert x.dtype == dtype and post.dtype == comb.dtype == torch.float32
    assert not (x.isnan().any() or post.isnan().any() or comb.isnan().any())
    torch.testing.assert_close(post, rpost, **MIX_TOL)
    torch.testing.assert_close(comb, rcomb, **MIX_TOL)
    torch.testing.assert_close(x, rx, **TOL[dtype])
    # Doubly stochastic after Sinkhorn: the last normalisation is over columns.
    torch.testing.assert_close(comb.sum(-2), torch.ones(t, n, device=device), rtol=0, atol=1e-5)


F32, BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize("t,n,d,dtype,cfg", [
    # Configs pick_config does not choose at these sizes: several tokens collapsed by the
    # finishing program (one launch), token blocks of 64 and 128 rows, and blocks under 16
    # rows (float32 FMAs instead of tl.dot).
    (7, 4, 64, F32, hc.HCConfig(16, 64, None, 4, 16)), (3, 4, 64, F32, hc.HCConfig(16, 32, 4, 4, 16)),
    (130, 4, 64, F32, hc.HCConfig(128, 64, 2, 8, 0)), (40, 4, 64, F32, hc.HCConfig(64, 32, 3, 8, 0)),
    (1, 4, 64, F32, hc.HCConfig(1, 64, 5, 2, 1)), (6, 4, 64, F32, hc.HCConfig(4, 32, None, 4, 0)),
    (3, 4, 64, F32, hc.HCConfig(2, 128, 2, 1, 4)),
    # bf16 streams against fn split into three bf16 parts per K step, with the float32
    # tf32x3 path's tolerances: n=3 leaves padding rows of fn (M=15 of 16 columns), D=40 a K
    # that is not a multiple of the K step; num_stages 2, 3 and 4.
    (40, 4, 64, BF16, hc.HCConfig(16, 32, 3, 4, 0, True)), (130, 4, 64, BF16, hc.HCConfig(128, 64, 2, 8, 0, True, 4)),
    (40, 4, 64, BF16, hc.HCConfig(16, 64, None, 4, 0, True)), (70, 3, 64, BF16, hc.HCConfig(32, 64, 3, 4, 0, True, 2)),
    (20, 3, 40, BF16, hc.HCConfig(16, 32, 2, 4, 0, True))])
def test_hc_pre_launch_configs(t, n, d, dtype, cfg, device, poison_empty):
    """Each launch config against the reference on random data."""
    gen = torch.Generator().manual_seed(t + n + d)
    s = streams_of(t, n, d, dtype, gen, device)
    fn, base, scale = weights(n, d, (2 + n) * n, gen, device)
    x, post, comb = hc.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6, config=cfg)
    rx, rpost, rcomb = reference.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6)
    torch.testing.assert_close(post, rpost, **MIX_TOL)
    torch.testing.assert_close(comb, rcomb, **MIX_TOL)
    torch.testing.assert_close(x, rx, **TOL[dtype])


@pytest.mark.parametrize("t,n,d,cfg", [
    (1, 4, 64, None), (5, 4, 40, None), (40, 3, 96, None), (300, 4, 64, None), (2, 4, 200, None),
    # A config whose finishing program would collapse 7 tokens itself: with the norm they go
    # to the collapse launch all the same.
    (7, 4, 64, hc.HCConfig(16, 64, None, 4, 16))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_norm_equals_the_norm_kernel_of_the_block_input(t, n, d, cfg, dtype, device, poison_empty):
    """With the block's RMSNorm fused into the collapse, the result is bit for bit the norm
    kernel's of the unfused block input, for the one-launch T=1 path, D not a power of two
    (40, 96, 200), n=3 and the large-T config; post and comb are unchanged; and it is the
    reference composition to the kernels' tolerance."""
    gen = torch.Generator().manual_seed(t * 31 + d)
    s = streams_of(t, n, d, dtype, gen, device)
    fn, base, scale = weights(n, d, (2 + n) * n, gen, device)
    w = (torch.randn(d, generator=gen) + 1).to(device)                   # float32, as V4's norms
    args = (s, fn, base, scale, 20, 1e-6, 1e-6)
    x, post, comb = hc.hc_pre(*args, config=cfg)
    y, ypost, ycomb = hc.hc_pre(*args, config=cfg, norm=(w, 1e-5))
    want = rms_norm(x, w, 1e-5, round_first=False)
    assert y.dtype == dtype and not y.isnan().any()
    assert not torch.equal(y, x)                                         # the norm did something
    assert torch.equal(y, want)
    assert torch.equal(ypost, post) and torch.equal(ycomb, comb)
    ref = reference.hc_pre(*args, norm=(w, 1e-5))[0]
    torch.testing.assert_close(y, ref, **TOL[dtype])


@pytest.mark.parametrize("t,n,d,group", [(1, 4, 64, 32), (5, 4, 256, 128), (3, 4, 96, 32)])
@pytest.mark.parametrize("pow2", [False, True], ids=["float32-scales", "pow2-scales"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_fp8_output_is_act_quant_of_the_normed_input(t, n, d, group, pow2, dtype, device, poison_empty):
    """With ``fp8`` the collapse launch also stores the normalised block input quantised for
    the block's FP8 linears: fp8_act_quant of it, bit for bit, for the plain and the lagged
    connection (D = 96: a row tile wider than the row); the rest of the result is unchanged."""
    from deepinfer.kernels.fp8_gemm import fp8_act_quant

    gen = torch.Generator().manual_seed(t * 13 + d)
    s = streams_of(t, n, d, dtype, gen, device)
    fn, base, scale = weights(n, d, (2 + n) * n, gen, device)
    norm = ((torch.randn(d, generator=gen) + 1).to(device), 1e-5)
    args = (s, fn, base, scale, 20, 1e-6, 1e-6)
    plain = hc.hc_pre(*args, norm=norm)
    x, post, comb, q, qs = hc.hc_pre(*args, norm=norm, fp8=(group, pow2))
    pre_in = (torch.rand(t, n, generator=gen) + 0.1).to(device)
    lagged = hc.hc_pre_lagged(*args, pre_in, norm=norm)
    lx, *lrest, lq, lqs = hc.hc_pre_lagged(*args, pre_in, norm=norm, fp8=(group, pow2))
    for got, want in ((x, plain[0]), (post, plain[1]), (comb, plain[2]), (lx, lagged[0])):
        assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(lrest, lagged[1:]))
    for (codes, scales), block_input in (((q, qs), x), ((lq, lqs), lx)):
        ref_q, ref_s = fp8_act_quant(block_input, group, pow2)
        assert torch.equal(codes.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(scales, ref_s)
        assert (codes.float() != 0).float().mean() > 0.9
    with pytest.raises(ValueError, match="fp8 output needs the norm"):
        hc.hc_pre(*args, fp8=(group, pow2))
    with pytest.raises(ValueError, match="group=48"):
        hc.hc_pre(*args, norm=norm, fp8=(48, pow2))


def test_reference_hc_pre_norm_is_the_plain_composition():
    gen = torch.Generator().manual_seed(11)
    n, d, t = 4, 48, 6
    s = streams_of(t, n, d, torch.bfloat16, gen, "cpu")
    fn, base, scale = weights(n, d, (2 + n) * n, gen, "cpu")
    w = torch.randn(d, generator=gen)
    x, post, comb = reference.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6)
    y, ypost, ycomb = reference.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6, (w, 1e-6))
    assert torch.equal(y, reference.rms_norm(x, w, 1e-6, round_first=False))
    assert torch.equal(ypost, post) and torch.equal(ycomb, comb)


def test_hc_pre_strided_rows_and_one_sinkhorn_iteration(device, poison_empty):
    """Streams that are every other row of a wider buffer; sinkhorn_iters=1 runs only the
    first column normalisation."""
    gen = torch.Generator().manual_seed(7)
    n, d = 4, 64
    buf = streams_of(12, n, d, torch.float32, gen, device)
    s = buf[::2]                                                         # [6, n, D], row stride 2*n*D
    fn, base, scale = weights(n, d, (2 + n) * n, gen, device)
    out = hc.hc_pre(s, fn, base, scale, 1, 1e-6, 1e-6, num_splits=2)
    ref = reference.hc_pre(s, fn, base, scale, 1, 1e-6, 1e-6)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, **MIX_TOL)


def test_hc_pre_leaves_its_block_counters_at_zero(device):
    """The finishing program resets its counter, so a second launch (a CUDA-graph replay)
    finds them zero and gives the same result."""
    gen = torch.Generator().manual_seed(3)
    n, d, t = 4, 64, 20
    s = streams_of(t, n, d, torch.float32, gen, device)
    fn, base, scale = weights(n, d, (2 + n) * n, gen, device)
    first = hc.hc_pre(s, fn, base, scale, 5, 1e-6, 1e-6, num_splits=3)
    assert int(tile_counters(s.device, 1).abs().sum()) == 0
    second = hc.hc_pre(s, fn, base, scale, 5, 1e-6, 1e-6, num_splits=3)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("t,n,splits", [(1, 4, None), (6, 4, 2), (3, 3, 3), (20, 4, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_head_matches_reference(t, n, splits, dtype, device, poison_empty):
    gen = torch.Generator().manual_seed(t + 100 * n)
    d = 64
    s = streams_of(t, n, d, dtype, gen, device)
    fn, base, scale = weights(n, d, n, gen, device)
    out = hc.hc_head(s, fn, base, scale, 1e-6, 1e-6, num_splits=splits)
    ref = reference.hc_head(s, fn, base, scale, 1e-6, 1e-6)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("t,n,d", [(1, 4, 64), (7, 4, 64), (5, 3, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_matches_reference(t, n, d, dtype, device, poison_empty):
    gen = torch.Generator().manual_seed(t * 7 + d)
    s = streams_of(t, n, d, dtype, gen, device)
    block_out = (torch.randn(t, d, generator=gen) * 3).to(dtype).to(device)
    post = (torch.rand(t, n, generator=gen) * 2).to(device)
    comb = torch.rand(t, n, n, generator=gen).to(device)
    out = hc.hc_post(block_out, s, post, comb)
    ref = reference.hc_post(block_out, s, post, comb)
    assert out.shape == (t, n, d) and out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("t,d,dtype", [(1, 256, F32), (6, 64, F32), (40, 64, BF16), pytest.param(300, 128, F32, marks=pytest.mark.slow),
                                       (300, 64, BF16)])
def test_stream_copies_read_as_one_row(t, d, dtype, device, poison_empty):
    """The first layer's streams are n copies of the embedding (an ``expand``: stream stride 0):
    the kernels read the one row n times, and give bit for bit what they give on the n copies
    materialised. T=1: the one-launch collapse; T=300: the large-T K tiles (and, in bf16, the
    three-part split of fn); with and without the block's norm."""
    n = 4
    gen = torch.Generator().manual_seed(t + d)
    row = (torch.randn(t, 1, d, generator=gen) * 2).to(dtype).to(device)
    copies, full = row.expand(-1, n, -1), row.expand(-1, n, -1).contiguous()
    assert copies.stride(1) == 0 and hc._streams_2d(copies, "test", 64)[1]
    fn, base, scale = weights(n, d, (2 + n) * n, gen, device)
    norm = (torch.rand(d, generator=gen).to(device) + 0.5, 1e-6)
    for nm in (None, norm):
        got = hc.hc_pre(copies, fn, base, scale, 20, 1e-6, 1e-6, norm=nm)
        want = hc.hc_pre(full, fn, base, scale, 20, 1e-6, 1e-6, norm=nm)
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        rx = reference.hc_pre(full, fn, base, scale, 20, 1e-6, 1e-6, nm)[0]
        torch.testing.assert_close(got[0], rx, **TOL[dtype])
    post = (torch.rand(t, n, generator=gen) * 2).to(device)
    comb = torch.rand(t, n, n, generator=gen).to(device)
    block_out = (torch.randn(t, d, generator=gen) * 3).to(dtype).to(device)
    assert torch.equal(hc.hc_post(block_out, copies, post, comb), hc.hc_post(block_out, full, post, comb))


def test_hc_launchers_name_the_bad_argument(device):
    s = torch.randn(2, 4, 64, device=device)
    fn = torch.randn(24, 256, device=device)
    with pytest.raises(ValueError, match="fn must be float32"):
        hc.hc_pre(s, fn[:, :128], torch.randn(24, device=device), torch.randn(3, device=device), 3, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="scale"):
        hc.hc_pre(s, fn, torch.randn(24, device=device), torch.randn(1, device=device), 3, 1e-6, 1e-6)
    with pytest.raises(ValueError, match="needs bfloat16 streams"):
        hc.hc_pre(s, fn, torch.randn(24, device=device), torch.randn(3, device=device), 3, 1e-6, 1e-6,
                  config=hc.HCConfig(16, 64, 2, 4, 0, True))
    with pytest.raises(ValueError, match="needs bfloat16 streams"):
        hc.hc_pre(s.bfloat16(), fn, torch.randn(24, device=device), torch.randn(3, device=device), 3, 1e-6,
                  1e-6, config=hc.HCConfig(4, 64, 2, 4, 0, True))
    with pytest.raises(ValueError, match="must be a bool"):
        hc.hc_pre(s.bfloat16(), fn, torch.randn(24, device=device), torch.randn(3, device=device), 3, 1e-6,
                  1e-6, config=hc.HCConfig(16, 64, 2, 4, 0, "memory"))
    with pytest.raises(ValueError, match="norm weight must be"):
        hc.hc_pre(s, fn, torch.randn(24, device=device), torch.randn(3, device=device), 3, 1e-6, 1e-6,
                  norm=(torch.ones(32, device=device), 1e-6))
    with pytest.raises(ValueError, match="comb"):
        hc.hc_post(torch.randn(2, 64, device=device), s, torch.rand(2, 4, device=device),
                   torch.rand(2, 4, 3, device=device))


def test_layers_give_the_same_streams_on_both_backends(monkeypatch, device):
    """HyperConnection / HyperHead through kernels/backend.py: forcing Triton (interpreter on
    the CPU) reproduces the torch path."""
    from deepinfer.layers.hyper_connection import HyperConnection, HyperHead
    torch.manual_seed(0)
    n, d, t = 4, 64, 5
    conn, head = HyperConnection(n, d, 20, 1e-6, 1e-6), HyperHead(n, d, 1e-6, 1e-6)
    for prm in list(conn.parameters()) + list(head.parameters()):
        torch.nn.init.normal_(prm, std=0.3)
    conn, head = conn.to(device), head.to(device)
    s = (torch.randn(t, n, d) * 2).to(device)
    block_out = torch.randn(t, d).to(device)

    norm_w = torch.randn(d).to(device)

    def run():
        x, post, comb = conn(s)
        normed = conn(s, norm=(norm_w, 1e-6))[0]
        new = conn.expand(block_out, s, post, comb)
        return x, normed, new, head(new)

    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    want = run()
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    got = run()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_hc_gpu_sizes(t):
    """V4-Flash widths: n=4, D=4096, bf16 streams; the fused norm bitwise as the norm kernel's."""
    gen = torch.Generator().manual_seed(t)
    n, d = 4, 4096
    s = streams_of(t, n, d, torch.bfloat16, gen, "cuda")
    fn, base, scale = weights(n, d, (2 + n) * n, gen, "cuda")
    out = hc.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6)
    ref = reference.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[2], ref[2], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out[0], ref[0], rtol=1.6e-2, atol=1e-2)
    assert int(tile_counters(s.device, 1).abs().sum()) == 0
    norm_w = torch.randn(d, device="cuda") + 1
    assert torch.equal(hc.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6, norm=(norm_w, 1e-6))[0],
                       rms_norm(out[0], norm_w, 1e-6, round_first=False))
    block_out = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(hc.hc_post(block_out, s, ref[1], ref[2]),
                               reference.hc_post(block_out, s, ref[1], ref[2]), rtol=1.6e-2, atol=1e-2)
    head_fn, head_base, head_scale = fn[:n].contiguous(), base[:n].contiguous(), scale[:1].contiguous()
    torch.testing.assert_close(hc.hc_head(s, head_fn, head_base, head_scale, 1e-6, 1e-6),
                               reference.hc_head(s, head_fn, head_base, head_scale, 1e-6, 1e-6),
                               rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("t,n,d,with_norm", [(1, 4, 64, True), (1, 4, 64, False), (5, 4, 64, True),
                                             (40, 4, 512, True), (300, 4, 64, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_pre_lagged_matches_reference(t, n, d, with_norm, dtype, device, poison_empty):
    """DeepSeek-V4.1's lagged connection: the block input collapses with a given pre (random,
    unlike the connection's own), the connection's pre comes back; T = 1 too, which the plain
    hc_pre collapses in its first launch."""
    gen = torch.Generator().manual_seed(t * 7 + d)
    s = streams_of(t, n, d, dtype, gen, device)
    fn, base, scale = weights(n, d, (2 + n) * n, gen, device)
    pre_in = (torch.rand(t, n, generator=gen) + 0.1).to(device)
    norm = ((torch.rand(d, generator=gen) + 0.5).to(device), 1e-6) if with_norm else None
    x, pre, post, comb = hc.hc_pre_lagged(s, fn, base, scale, 20, 1e-6, 1e-6, pre_in, norm=norm)
    rx, rpre, rpost, rcomb = reference.hc_pre_lagged(s, fn, base, scale, 20, 1e-6, 1e-6, pre_in, norm)
    torch.testing.assert_close(pre, rpre, **MIX_TOL)
    torch.testing.assert_close(post, rpost, **MIX_TOL)
    torch.testing.assert_close(comb, rcomb, **MIX_TOL)
    torch.testing.assert_close(x, rx, **TOL[dtype])
    # The collapse used pre_in, not the connection's own pre.
    own = reference.hc_pre(s, fn, base, scale, 20, 1e-6, 1e-6, norm)[0]
    assert not torch.allclose(x.float(), own.float(), atol=1e-2)
