"""The CUDA batch-invariant mode's kernels (kernels/batch_invariant_ops.py, the CUDA overrides of
batch_invariant.py, and the fixed configs our own kernels take in the mode) on random data:
against torch, and a row's bits the same whatever the number of rows around it (M = 1, 3, 17,
64, the row at a random place among random others). On a CUDA machine they run on the device,
elsewhere in Triton's interpreter (tests/kernels/conftest.py)."""

import dataclasses

import pytest
import torch

from deepinfer import batch_invariant
from deepinfer.kernels import batch_invariant_ops as ops
from deepinfer.kernels import reference
from deepinfer.kernels import fused_moe as fm
from deepinfer.kernels.fused_moe import MoEConfig
from deepinfer.kernels.paged_attention import paged_attention, paged_decode_attention_invariant
from deepinfer.kernels.sparse_attention import invariant_config, sparse_attention
from tests.kernels.test_paged_attention import build_cache

MS = (1, 3, 17, 64)


def _embedded(row: torch.Tensor, m: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """``row`` [1, ...] at a random place among m - 1 random rows."""
    others = torch.randn(m, *row.shape[1:], generator=gen).to(row.dtype).to(row.device)
    at = int(torch.randint(m, (1,), generator=gen))
    others[at] = row[0]
    return others, at


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_matches_torch_and_rows_do_not_depend_on_m(dtype, device):
    gen = torch.Generator().manual_seed(0)
    k, n = 100, 90
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    b = w.t()                                           # [K, N], a transposed view (F.linear's)
    row = torch.randn(1, k, generator=gen).to(device, dtype)
    want = ops.mm(row, b)
    torch.testing.assert_close(want.float(), row.float() @ b.float(), rtol=1e-3, atol=1e-3)
    for m in MS:
        a, at = _embedded(row, m, gen)
        got = ops.mm(a, b)
        torch.testing.assert_close(got.float(), a.float() @ b.float(), rtol=1e-3, atol=2e-3)
        assert torch.equal(got[at], want[0]), m
    # A bmm entry equals the same product as an mm, and does not depend on the batch count.
    x = torch.randn(3, 5, k, generator=gen).to(device, dtype)
    y = torch.randn(3, k, n, generator=gen).to(device, dtype)
    batched = ops.bmm(x, y)
    torch.testing.assert_close(batched.float(), torch.bmm(x.float(), y.float()), rtol=1e-3, atol=2e-3)
    assert torch.equal(ops.bmm(x[1:2], y[1:2])[0], batched[1])
    assert torch.equal(ops.mm(x[2], y[2]), batched[2])


# A split config for small test shapes: N=96 over 32-column tiles and K=256 in 16-deep steps
# give four K slices (matmul_split), so the partials and their ordered sum run.
SPLIT_CFG = ops.MatmulConfig(16, 32, 16, 4, 2, max_split=4)


HALF = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
MATMUL_CASES = ([(cfg, dtype, 96, 256, split) for cfg, split in ((ops.LEGACY_MATMUL, 1), (ops.SPLIT_MATMUL_F32, 2),
                                                                 (SPLIT_CFG, 4))
                 for dtype in [torch.float32] + HALF]
                # The 16-bit default over a weight it splits eight ways (2 column tiles, 32 K steps).
                + [(ops.SPLIT_MATMUL, dtype, 256, 2048, 8) for dtype in HALF])


@pytest.mark.parametrize("cfg,dtype,n,k,split", MATMUL_CASES,
                         ids=lambda v: v.label.replace(" ", "_") if isinstance(v, ops.MatmulConfig) else str(v))
def test_matmul_configs_keep_a_row_whatever_m(cfg, dtype, n, k, split, device):
    """Each fixed config, split K included: a row's bits are the same alone and among 7, 64 or
    200 rows (several M-tiles, every tile split), and equal torch's product within rounding."""
    gen = torch.Generator().manual_seed(7)
    assert ops.matmul_split(cfg, n, k, 132) == split
    b = torch.randn(n, k, generator=gen).to(device, dtype).t()          # [K, N], F.linear's view
    row = torch.randn(1, k, generator=gen).to(device, dtype)
    want = ops.mm(row, b, config=cfg)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.1)
    torch.testing.assert_close(want.float(), row.float() @ b.float(), **tol)
    for m in (7, 64, 200):
        a, at = _embedded(row, m, gen)
        got = ops.mm(a, b, config=cfg)
        torch.testing.assert_close(got.float(), a.float() @ b.float(), **tol)
        assert torch.equal(got[at], want[0]), m


# Large-M tile from 100 rows on: M = 1, 7, 64 take the split launch (four slices, one program
# each), M = 200 the 128 x 64 tiles walking the same four slices in order.
LARGE_CFG = ops.MatmulConfig(64, 32, 16, 4, 2, max_split=4, large=ops.MatmulTile(128, 64, 4, 2), large_min_m=100)


@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
def test_large_m_tile_walks_the_same_slices(dtype, device):
    """A config with a large-M tile: the split launch below ``large_min_m`` rows and the in-order
    slices of the large tile above it give a row the same bits, close to torch's product."""
    gen = torch.Generator().manual_seed(11)
    n, k = 96, 256
    assert ops.matmul_launch(LARGE_CFG, 7, n, k, 132) == (64, 32, 4, 2, 4, True)
    assert ops.matmul_launch(LARGE_CFG, 200, n, k, 132) == (128, 64, 4, 2, 4, False)
    b = torch.randn(n, k, generator=gen).to(device, dtype).t()
    row = torch.randn(1, k, generator=gen).to(device, dtype)
    want = ops.mm(row, b, config=LARGE_CFG)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=0.1)
    for m in (7, 200, 300):
        a, at = _embedded(row, m, gen)
        got = ops.mm(a, b, config=LARGE_CFG)
        torch.testing.assert_close(got.float(), a.float() @ b.float(), **tol)
        assert torch.equal(got[at], want[0]), m
    # The slices are summed as the split launch sums them, not as one unsplit walk over K.
    unsplit = dataclasses.replace(LARGE_CFG, max_split=1)
    torch.testing.assert_close(ops.mm(a, b, config=unsplit).float(), got.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32] + HALF)
def test_tma_tiles_give_the_pointer_loads_bits(dtype, device):
    """A TMA config reads the same tiles as its pointer-load twin (zeros past the edges: M = 7
    and 200 leave partial row tiles, K = 200 a partial K step), so the products are bitwise
    equal, split launch and large tile alike; operands TMA cannot read (a batch of two, a
    misaligned row stride) take the pointer loads."""
    gen = torch.Generator().manual_seed(12)
    n, k = 96, 200
    tma_cfg = dataclasses.replace(LARGE_CFG, tma=True)
    assert tma_cfg.label.endswith(" tma")
    w = torch.randn(n, k, generator=gen).to(device, dtype)
    for m in (1, 7, 200):
        a = torch.randn(m, k, generator=gen).to(device, dtype)
        want = ops.mm(a, w.t(), config=LARGE_CFG)
        assert torch.equal(ops.mm(a, w.t(), config=tma_cfg), want), m
    x = torch.randn(2, 5, k, generator=gen).to(device, dtype)
    y = torch.randn(2, k, n, generator=gen).to(device, dtype)
    assert torch.equal(ops.bmm(x, y, config=tma_cfg), ops.bmm(x, y, config=LARGE_CFG))
    odd = torch.randn(5, k + 1, generator=gen).to(device, dtype)[:, :k]     # rows k + 1 apart
    assert not ops._tma_ready(odd, w)
    assert torch.equal(ops.mm(odd, w.t(), config=tma_cfg), ops.mm(odd, w.t(), config=LARGE_CFG))


def test_split_k_is_deterministic_and_leaves_its_counters_zeroed(device):
    """Two runs of a split product give the same bits (the slices are summed in slice order,
    whichever finishes last), batch entries included, and the tile counters are zero again after
    (what a CUDA-graph replay needs)."""
    from deepinfer.kernels.launch import tile_counters

    gen = torch.Generator().manual_seed(8)
    a = torch.randn(3, 33, 256, generator=gen).to(device)
    b = torch.randn(3, 256, 96, generator=gen).to(device)
    first = ops.bmm(a, b, config=SPLIT_CFG)
    assert torch.equal(ops.bmm(a, b, config=SPLIT_CFG), first)
    torch.testing.assert_close(first, torch.bmm(a, b), rtol=1e-4, atol=1e-4)
    # The split sums differ from the unsplit ones in rounding only.
    torch.testing.assert_close(first, ops.bmm(a, b, config=ops.LEGACY_MATMUL), rtol=1e-5, atol=1e-4)
    assert not tile_counters(a.device, 1).any()
    assert torch.equal(ops.bmm(a[1:2], b[1:2], config=SPLIT_CFG)[0], first[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(1024, 4096), (4096, 4096), (512, 4096), (32768, 1024)])
@pytest.mark.parametrize("cfg", [ops.SPLIT_MATMUL, ops.DEFAULT_MATMUL,
                                 dataclasses.replace(ops.DEFAULT_MATMUL, tma=True)],
                         ids=["split", "default", "default_tma"])
def test_split_matmul_at_v4_flash_widths_in_cuda_graphs(cfg, n, k):
    """The 16-bit split configs at V4-Flash decode widths (split K on an H100/H200; the default's
    large tile from 256 rows on): bf16 rows bitwise the same at M = 1, 16, 64, 300, 4096, close to
    cuBLAS, and CUDA-graph replays equal to the eager call (the tile counters are zero again after
    every launch)."""
    from tests.kernels.conftest import capture

    gen = torch.Generator(device="cuda").manual_seed(n)
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    x = torch.randn(4096, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert ops.matmul_split(cfg, n, k, sms) > 1 or n > 4096
    want = ops.mm(x[:1], w.t(), config=cfg)
    for m in (16, 64, 300, 4096):
        got = ops.mm(x[:m], w.t(), config=cfg)
        torch.testing.assert_close(got.float(), (x[:m] @ w.t()).float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(got[0], want[0]), m
        if cfg.tma:                          # TMA tiles into the same MMAs as the pointer loads'
            assert torch.equal(got, ops.mm(x[:m], w.t(), config=dataclasses.replace(cfg, tma=False))), m
    graph, out = capture(lambda: ops.mm(x[:16], w.t(), config=cfg))
    eager = ops.mm(x[:16], w.t(), config=cfg)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


def test_matmul_config_override_and_validation(device, monkeypatch):
    gen = torch.Generator().manual_seed(9)
    a, b = torch.randn(5, 256, generator=gen).to(device), torch.randn(256, 96, generator=gen).to(device)
    monkeypatch.setattr(ops, "MATMUL_CONFIG", SPLIT_CFG)
    assert ops.matmul_config(96, 256, torch.float16) is SPLIT_CFG
    assert torch.equal(ops.mm(a, b), ops.mm(a, b, config=SPLIT_CFG))
    monkeypatch.setattr(ops, "MATMUL_CONFIG", None)
    assert ops.matmul_config(96, 256, torch.bfloat16) == ops.DEFAULT_MATMUL
    assert ops.matmul_config(96, 256, torch.float32) == ops.DEFAULT_MATMUL_F32
    # Wide N fills the SMs with tiles alone: no split; a short K gives too few steps to slice.
    assert ops.matmul_split(ops.SPLIT_MATMUL, 129280, 4096, 132) == 1
    assert ops.matmul_split(ops.SPLIT_MATMUL, 4096, 4096, 132) == 4
    assert ops.matmul_split(ops.SPLIT_MATMUL, 4096, 128, 132) == 1
    assert ops.matmul_split(dataclasses.replace(ops.SPLIT_MATMUL, waves=2), 4096, 4096, 132) == 8
    with pytest.raises(ValueError, match="block_n=48"):
        ops.MatmulConfig(64, 48, 64, 4, 4)
    with pytest.raises(ValueError, match="max_split=3"):
        ops.MatmulConfig(64, 64, 64, 4, 4, max_split=3)
    with pytest.raises(ValueError, match="waves=0"):
        ops.MatmulConfig(64, 64, 64, 4, 4, waves=0)
    # Both launches of a large-tile config on one MMA instruction: 64-row tiles, warps in fours.
    with pytest.raises(ValueError, match="32x64 with 4 warps"):
        ops.MatmulConfig(32, 64, 64, 4, 4, large=ops.MatmulTile(128, 128, 8, 3))
    with pytest.raises(ValueError, match="128x128 with 2 warps"):
        ops.MatmulConfig(64, 64, 64, 4, 4, large=ops.MatmulTile(128, 128, 2, 3))


@pytest.mark.parametrize("op", ["softmax", "log_softmax", "sum", "mean", "logsumexp"])
def test_row_reductions_match_torch_and_rows_do_not_depend_on_m_or_padding(op, device):
    gen = torch.Generator().manual_seed(1)
    width = 1500                                        # two column steps of ROW_BLOCK
    run = {"softmax": lambda t: ops.softmax(t, -1, False), "log_softmax": lambda t: ops.softmax(t, -1, True),
           "sum": lambda t: ops.reduce(t, -1, False, ops.SUM), "mean": lambda t: ops.reduce(t, -1, False, ops.MEAN),
           "logsumexp": lambda t: ops.reduce(t, -1, False, ops.LOGSUMEXP)}[op]
    stock = {"softmax": lambda t: t.softmax(-1), "log_softmax": lambda t: t.log_softmax(-1),
             "sum": lambda t: t.sum(-1), "mean": lambda t: t.mean(-1), "logsumexp": lambda t: t.logsumexp(-1)}[op]
    row = (torch.randn(1, width, generator=gen) * 4).to(device)
    want = run(row)
    torch.testing.assert_close(want, stock(row), rtol=1e-5, atol=1e-5)
    for m in MS:
        x, at = _embedded(row, m, gen)
        assert torch.equal(run(x)[at], want[0]), m
    # A row padded at its end (zeros for the sums, -inf for the softmaxes) keeps its bits.
    fill = 0.0 if op in ("sum", "mean") else float("-inf")
    padded = run(torch.cat([row, torch.full((1, 77), fill, device=device)], dim=1))
    if op in ("softmax", "log_softmax"):
        assert torch.equal(padded[:, :width], want)
    elif op != "mean":                                  # the mean divides by the padded width
        assert torch.equal(padded, want)


def test_reductions_over_other_dims_and_dtypes(device):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(4, 6, 50, generator=gen).to(device)
    torch.testing.assert_close(ops.reduce(x, [0, 2], True, ops.SUM), x.sum((0, 2), keepdim=True), rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(ops.reduce(x, 1, False, ops.MEAN), x.mean(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ops.reduce(x, None, False, ops.SUM), x.sum(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.softmax(x, 1, True), x.log_softmax(1), rtol=1e-5, atol=1e-5)
    h = x.half()
    got = ops.softmax(h, -1, False, torch.float32)      # _softmax's half_to_float
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, h.float().softmax(-1), rtol=1e-5, atol=1e-6)
    assert ops.reduce(h, -1, False, ops.SUM, torch.float32).dtype == torch.float32
    # A reduction over a middle dim: token t's result does not depend on how many tokens.
    full = ops.reduce(x, 1, False, ops.SUM)
    assert torch.equal(ops.reduce(x[2:3], 1, False, ops.SUM)[0], full[2])
    with pytest.raises(ValueError, match="must share a dtype"):
        ops.mm(torch.randn(2, 3, device=device), torch.randn(3, 2, device=device).half())


def test_cuda_overrides_match_the_stock_ops(device):
    """The functions the mode registers on the CUDA key (called directly, so off CUDA too)."""
    gen = torch.Generator().manual_seed(3)
    a, w, bias = (torch.randn(5, 40, generator=gen).to(device), torch.randn(30, 40, generator=gen).to(device),
                  torch.randn(30, generator=gen).to(device))
    close = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(batch_invariant._cuda_addmm(bias, a, w.t()), torch.addmm(bias, a, w.t()), **close)
    torch.testing.assert_close(batch_invariant._cuda_addmm(bias, a, w.t(), beta=0.5, alpha=2.0),
                               torch.addmm(bias, a, w.t(), beta=0.5, alpha=2.0), **close)
    x3, y3 = torch.randn(2, 5, 40, generator=gen).to(device), torch.randn(2, 40, 7, generator=gen).to(device)
    base = torch.randn(2, 5, 7, generator=gen).to(device)
    torch.testing.assert_close(batch_invariant._cuda_baddbmm(base, x3, y3), torch.baddbmm(base, x3, y3), **close)
    torch.testing.assert_close(batch_invariant._cuda_mm(a, w.t()), a @ w.t(), **close)
    x = torch.randn(3, 4, 20, generator=gen).to(device)
    torch.testing.assert_close(batch_invariant._cuda_reduce("sum")(x, [1], True), x.sum(1, keepdim=True))
    torch.testing.assert_close(batch_invariant._cuda_reduce("mean")(x, [-1]), x.mean(-1))
    torch.testing.assert_close(batch_invariant._cuda_logsumexp(x, [2]), x.logsumexp(2))
    torch.testing.assert_close(batch_invariant._cuda_softmax(True)(x, 1, False), x.log_softmax(1))
    # Integer sums (exact in any order) go to the stock kernel, with its int64 result.
    ints = torch.randint(0, 5, (3, 7), generator=gen).to(device)
    assert torch.equal(batch_invariant._cuda_reduce("sum")(ints, [-1]), ints.sum(-1))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_invariant_paged_attention_decode_equals_prefill_and_chunks(window, with_sinks, device):
    """The mode's attention: a query's output is the same bits whether it is decoded, the last
    token of a whole prompt, or in a chunk of another size, and whatever shares the call."""
    gen = torch.Generator().manual_seed(4)
    bs, hq, hkv, d = 4, 6, 2, 16
    lens = [70, 9, 33]
    cache, table = build_cache(lens, bs, hkv, d, gen)
    cache, table = cache.to(device), table.to(device)
    sinks = torch.randn(hq, generator=gen).to(device) if with_sinks else None
    scale = 0.25
    # The prefill of sequence 0 whole, alone: its last token's output.
    q0 = torch.randn(lens[0], hq, d, generator=gen).to(device)
    whole = paged_attention(q0, cache, table[:1], [0, lens[0]], lens[:1], scale, window, sinks, invariant=True)
    want = reference.paged_attention(q0, cache, table[:1], [0, lens[0]], lens[:1], scale, window, sinks)
    torch.testing.assert_close(whole, want, rtol=1e-4, atol=1e-4)
    last = whole[-1]
    # As a decode in a batch of three (the device-built tile table), and as the last token of
    # a 7-token chunk next to other sequences' chunks.
    qd = torch.randn(3, hq, d, generator=gen).to(device)
    qd[0] = q0[-1]
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    decoded = paged_decode_attention_invariant(qd, cache, table, lens_t, scale, window, sinks)
    assert torch.equal(decoded[0], last)
    chunk = torch.cat([q0[-7:], torch.randn(9 + 2, hq, d, generator=gen).to(device)])
    got = paged_attention(chunk, cache, table, [0, 7, 16, 18], lens, scale, window, sinks, invariant=True)
    assert torch.equal(got[6], last)
    alone = paged_decode_attention_invariant(q0[-1:], cache, table[:1], lens_t[:1], scale, window, sinks)
    assert torch.equal(alone[0], last)


def test_invariant_sparse_attention_config_does_not_depend_on_the_batch(device):
    """One token's sparse attention with the mode's config: the same bits alone and among more
    tokens whose slot rows are wider (its row padded with -1 at the end)."""
    gen = torch.Generator().manual_seed(5)
    h, d, bs = 4, 32, 8
    cache = torch.randn(12, bs, 1, 1, d, generator=gen).to(device)
    sinks = torch.randn(h, generator=gen).to(device)
    q = torch.randn(1, h, d, generator=gen).to(device)
    row = torch.randperm(12 * bs, generator=gen)[:37].to(device)
    alone = sparse_attention(q, [(cache, row[None])], sinks, 0.2, config=invariant_config(q))
    torch.testing.assert_close(alone, reference.sparse_attention(q, [(cache, row[None])], sinks, 0.2),
                               rtol=1e-4, atol=1e-4)
    for m in (3, 17):
        qs = torch.randn(m, h, d, generator=gen).to(device)
        qs[1] = q[0]
        slots = torch.randint(0, 12 * bs, (m, 90), generator=gen).to(device)
        slots[1] = -1
        slots[1, :37] = row
        got = sparse_attention(qs, [(cache, slots)], sinks, 0.2, config=invariant_config(qs))
        assert torch.equal(got[1], alone[0]), m
    assert invariant_config(torch.empty(1, h, d)) == invariant_config(torch.empty(4096, h, d))


def test_fixed_configs_of_our_kernels_keep_a_row_whatever_the_batch(device):
    """The router, fused-MoE and hyper-connection kernels with the mode's configs (the ones
    backend.py passes): a token's outputs are the same bits alone and among 2, 16 or 63 others."""
    from deepinfer.kernels import hyper_connection as hc
    from deepinfer.kernels.fused_moe import fused_moe
    from deepinfer.kernels.router import invariant_config as router_config
    from deepinfer.kernels.router import router_logits
    from tests.kernels.test_hyper_connection import weights

    gen = torch.Generator().manual_seed(6)
    h, e, k, i, n = 512, 8, 2, 32, 4          # 512: the router takes two ranges of H
    router_w = torch.randn(e, h, generator=gen).to(device)
    assert router_config(router_w).split_k == 2
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) * 0.1).to(device)
    down = (torch.randn(e, h, i, generator=gen) * 0.1).to(device)
    fn, base, scale = weights(n, h // n, (2 + n) * n, gen, device)
    x = torch.randn(1, h, generator=gen).to(device)
    ids = torch.tensor([[3, 5]], device=device)
    tw = torch.rand(1, k, generator=gen).to(device)

    def run(xs, ids_, tw_):
        streams = xs.view(-1, n, h // n)
        return (router_logits(xs, router_w, router_config(router_w)),
                fused_moe(xs, gate_up, down, tw_, ids_, invariant=True),
                *hc.hc_pre(streams, fn, base, scale, 3, 1e-6, 1e-6, config=hc.invariant_config(xs.dtype)))

    want = run(x, ids, tw)
    torch.testing.assert_close(want[0], reference.router_logits(x, router_w), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(want[1], reference.moe_experts(x, gate_up, down, tw, ids), rtol=1e-4, atol=1e-4)
    for m in MS[1:]:
        xs, at = _embedded(x, m, gen)
        ids_m = torch.randint(0, e, (m, k), generator=gen).to(device)
        ids_m[at] = ids[0]
        tw_m = torch.rand(m, k, generator=gen).to(device)
        tw_m[at] = tw[0]
        for got, ref in zip(run(xs, ids_m, tw_m), want):
            assert torch.equal(got[at], ref[0]), m


def test_hc_invariant_config_of_bf16_streams_keeps_a_token(device):
    """bf16 streams take the mode's config with fn split into three bf16 parts (``bf16_split``):
    a token's pre / post / comb / collapse are the same bits alone and among 2, 16, 63 or 199
    others (past the mode's 128-token block), and they match the reference in float32."""
    from deepinfer.kernels import hyper_connection as hc
    from tests.kernels.test_hyper_connection import weights

    cfg = hc.invariant_config(torch.bfloat16)
    assert cfg.bf16_split and not hc.invariant_config(torch.float32).bf16_split
    gen = torch.Generator().manual_seed(9)
    n, d = 4, 128
    fn, base, scale = weights(n, d, (2 + n) * n, gen, device)
    s = (torch.randn(1, n, d, generator=gen) * 2).to(torch.bfloat16).to(device)
    want = hc.hc_pre(s, fn, base, scale, 3, 1e-6, 1e-6, config=cfg)
    ref = reference.hc_pre(s, fn, base, scale, 3, 1e-6, 1e-6)
    for got, r in zip(want, ref):
        torch.testing.assert_close(got.float(), r.float(), rtol=2e-2, atol=2e-2)
    for m in (*MS[1:], 200):
        ss, at = _embedded(s, m, gen)
        for got, one in zip(hc.hc_pre(ss, fn, base, scale, 3, 1e-6, 1e-6, config=cfg), want):
            assert torch.equal(got[at], one[0]), m


MOE_CONFIGS = [None, fm.ROWS64_INVARIANT_CONFIG, MoEConfig(16, 32, 64, 64, 32, 1, num_warps=4, num_stages=2),
               MoEConfig(32, 32, 32, 32, 32, 4, num_warps=4, num_stages=2, tma=True, sorted_act=True)]


# rows32_tma (about 7 s in the interpreter) with -m slow: rows64_tma keeps a TMA config and rows16
# a small-row one in the default run.
@pytest.mark.parametrize("cfg", [pytest.param(c, id=name, marks=pytest.mark.slow if name == "rows32_tma" else ())
                                 for c, name in zip(MOE_CONFIGS, ["default", "rows64_tma", "rows16", "rows32_tma"])])
def test_moe_invariant_configs_keep_a_token_whatever_t(cfg, device, monkeypatch):
    """fused_moe and fp4_moe in the mode under the default invariant config and others the probe
    sweeps (fused_moe.INVARIANT_CONFIG): a token's outputs are the same bits alone and among 7,
    64 or 200 tokens, and match the references."""
    from deepinfer.kernels.fp4_moe import fp4_moe
    from deepinfer.models.quant import quant_fp4_e2m1

    monkeypatch.setattr(fm, "INVARIANT_CONFIG", cfg)
    gen = torch.Generator().manual_seed(10)
    e, h, i, k = 8, 64, 64, 2
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(device)
    down = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(device)
    fp4 = [w.to(device) for w in (*quant_fp4_e2m1(gate_up.cpu(), 32, "ue8m0"),
                                  *quant_fp4_e2m1(down.cpu(), 32, "ue8m0"))]
    x = torch.randn(1, h, generator=gen).to(device)
    ids = torch.tensor([[3, 5]], device=device)
    tw = torch.rand(1, k, generator=gen).to(device) + 0.1

    def run(xs, ids_, tw_):
        return (fm.fused_moe(xs, gate_up, down, tw_, ids_, 0.7, invariant=True),
                fp4_moe(xs, *fp4, tw_, ids_, 0.7, invariant=True))

    want = run(x, ids, tw)
    torch.testing.assert_close(want[0], reference.clamped_moe_experts(x, gate_up, down, tw, ids, 0.7),
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(want[1], reference.fp4_moe_experts(x, *fp4, tw, ids, 0.7), rtol=1e-4, atol=1e-4)
    for t in (7, 64, 200):
        xs, at = _embedded(x, t, gen)
        ids_t = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(device)
        ids_t[at] = ids[0]
        tw_t = torch.rand(t, k, generator=gen).to(device) + 0.1
        tw_t[at] = tw[0]
        for got, ref in zip(run(xs, ids_t, tw_t), want):
            assert torch.equal(got[at], ref[0]), t
    assert fm.invariant_config(4096, 2048) == fm.fit_config(cfg or fm.DEFAULT_INVARIANT_CONFIG, 4096, 2048)


def test_cuda_overrides_leave_other_dtypes_to_the_stock_kernels():
    # CPU tensors on any machine: the fallbacks never reach a Triton kernel.
    a, b = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    assert torch.equal(batch_invariant._cuda_mm(a, b), torch.ops.aten.mm.out(a, b, out=torch.empty(4, 3,
                                                                                           dtype=torch.float64)))
    bias = torch.randn(3, dtype=torch.float64)
    torch.testing.assert_close(batch_invariant._cuda_addmm(bias, a, b, beta=2.0), torch.addmm(bias, a, b, beta=2.0))
    ints = torch.randint(0, 4, (2, 4, 6)), torch.randint(0, 4, (2, 6, 3))
    assert torch.equal(batch_invariant._cuda_bmm(*ints), torch.bmm(*ints))
