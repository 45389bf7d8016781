"""The decode GEMV (kernels/gemv.py) against reference.gemv / reference.grouped_gemv: FMA
and tl.dot accumulation, with and without split-K, ragged N and K, strided x; the
backend's dispatch and the layers built on it; and, on the GPU, DeepSeek-V4's shapes."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import backend, gemv as gemv_module, reference
from deepinfer.kernels.gemv import GemvConfig, gemv, grouped_gemv, pick_config
from deepinfer.layers.deepseek_v4_attention import GroupedLinear
from deepinfer.layers.deepseek_v4_moe import DeepseekV4SharedExpert
from deepinfer.layers.linear import Linear

from .conftest import ON_CUDA

TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 5e-5},     # float32 sums in another order
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
    # The CPU interpreter truncates float32 -> bfloat16 (two ulps, see conftest.py).
    torch.bfloat16: {"rtol": 1.6e-2, "atol": 1e-2},
}
FMA = GemvConfig(block_n=16, block_k=32, split_k=1, use_dot=False, num_warps=4, num_stages=1)
FMA_SPLIT = GemvConfig(block_n=16, block_k=32, split_k=3, use_dot=False, num_warps=4, num_stages=1)
DOT = GemvConfig(block_n=16, block_k=16, split_k=1, use_dot=True, num_warps=4, num_stages=2)
DOT_SPLIT = GemvConfig(block_n=32, block_k=16, split_k=4, use_dot=True, num_warps=4, num_stages=2)
CONFIGS = {"pick": None, "fma": FMA, "fma_split": FMA_SPLIT, "dot": DOT, "dot_split": DOT_SPLIT}


def rand(*shape: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Random, never zero: a kernel that skips a load cannot match by accident."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return torch.where(x.abs() < 1e-3, 0.5, x).to(dtype).to(device)


def uses_dot(config: GemvConfig | None, m: int, n: int, k: int, groups: int = 1) -> bool:
    return (config or pick_config(m, n, k, groups)).use_dot


def skip_interpreter_bf16_dot(dtype: torch.dtype, dot: bool) -> None:
    if dtype == torch.bfloat16 and dot and not ON_CUDA:
        pytest.skip("the CPU interpreter multiplies bfloat16 tl.dot tiles as raw integers (conftest.py)")


def expected(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The reference in float32 from the same (rounded) inputs."""
    return reference.gemv(x.float(), w.float(), None if residual is None else residual.float())


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (3, 70, 200), (16, 33, 64), (2, 24, 100)])
def test_matches_reference(m, n, k, dtype, config, device, poison_empty):
    """N not a multiple of BLOCK_N, K not a multiple of BLOCK_K (except k=64), splits of K."""
    cfg = CONFIGS[config]
    skip_interpreter_bf16_dot(dtype, uses_dot(cfg, m, n, k))
    x = rand(m, k, seed=m + k, dtype=dtype, device=device)
    w = rand(n, k, seed=n, dtype=dtype, device=device) / k ** 0.5
    out = gemv(x, w, config=cfg)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), expected(x, w), **TOL[dtype])


@pytest.mark.parametrize("config", ["fma_split", "dot_split"])
def test_strided_x_out_and_residual(config, device, poison_empty):
    """x a column slice of a wider buffer (row stride 150), written into a column slice of a
    wider output, residual added before rounding."""
    m, n, k = 5, 40, 96
    buf = rand(m, 150, seed=1, device=device)
    x = buf[:, 20:20 + k]
    assert x.stride(0) == 150
    w = rand(n, k, seed=2, device=device)
    residual = rand(m, n, seed=3, device=device)
    out_buf = torch.full((m, 64), 7.0, device=device)
    got = gemv(x, w, out=out_buf[:, 8:8 + n], residual=residual, config=CONFIGS[config])
    assert got.data_ptr() == out_buf[:, 8:].data_ptr()
    torch.testing.assert_close(got, expected(x, w, residual), **TOL[torch.float32])
    assert (out_buf[:, :8] == 7.0).all() and (out_buf[:, 8 + n:] == 7.0).all()


@pytest.mark.parametrize("config", ["pick", "fma_split", "dot_split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,groups,kg,ng", [(1, 4, 64, 24), (5, 3, 48, 40)])
def test_grouped_matches_reference(m, groups, kg, ng, dtype, config, device, poison_empty):
    """x [M, G, Kg] a slice of a wider buffer (group stride Kg + 16)."""
    cfg = CONFIGS[config]
    skip_interpreter_bf16_dot(dtype, uses_dot(cfg, m, ng, kg, groups))
    x = rand(m, groups, kg + 16, seed=m, dtype=dtype, device=device)[:, :, 8:8 + kg]
    w = rand(groups * ng, kg, seed=groups, dtype=dtype, device=device) / kg ** 0.5
    out = grouped_gemv(x, w, config=cfg)
    assert out.dtype == dtype and out.shape == (m, groups, ng)
    torch.testing.assert_close(out.float(), reference.grouped_gemv(x.float(), w.float()), **TOL[dtype])


@pytest.mark.parametrize("config", ["fma_split", "dot_split"])
def test_split_k_is_deterministic_and_resets_its_counters(config, device):
    m, n, k = 3, 40, 200
    x, w = rand(m, k, seed=4, device=device), rand(n, k, seed=5, device=device)
    first = gemv(x, w, config=CONFIGS[config])
    for _ in range(2):
        assert torch.equal(gemv(x, w, config=CONFIGS[config]), first)
    assert not gemv_module._COUNTERS[x.device].any()


def test_pick_config():
    """Split-K only where the N-tiles alone are few; the config is a function of the shapes."""
    assert pick_config(1, 32768, 1024).split_k == 1                 # q_b: 1024 N-tiles
    for m, n, k in [(1, 1024, 4096), (16, 1024, 4096), (1, 4096, 8192), (16, 4096, 2048)]:
        assert pick_config(m, n, k).split_k > 1
    assert pick_config(1, 1024, 4096, groups=8).split_k == 1        # o_a: 256 N-tiles of 32
    assert pick_config(16, 1024, 4096, groups=8).split_k > 1        # 128 N-tiles of 64
    assert not pick_config(1, 4096, 4096).use_dot and pick_config(16, 4096, 4096).use_dot
    tiny = pick_config(16, 20, 24)
    assert (tiny.block_n, tiny.block_k, tiny.split_k) == (32, 32, 1)


def test_empty_rows(device):
    w = rand(8, 32, seed=6, device=device)
    assert gemv(torch.empty(0, 32, device=device), w).shape == (0, 8)
    assert grouped_gemv(torch.empty(0, 2, 32, device=device), w).shape == (0, 2, 4)


def test_rejects_bad_arguments(device):
    x, w = torch.ones(2, 32, device=device), torch.ones(8, 32, device=device)
    with pytest.raises(ValueError, match="x has 17 rows"):
        gemv(torch.ones(17, 32, device=device), w)
    with pytest.raises(ValueError, match="x must be float32/bfloat16/float16"):
        gemv(x.double(), w.double())
    with pytest.raises(ValueError, match="x must be \\[M, K\\]"):
        gemv(x[0], w)
    with pytest.raises(ValueError, match="x must have a unit last stride"):
        gemv(torch.ones(32, 2, device=device).t(), w)
    with pytest.raises(ValueError, match="weight must be \\[N, 32\\]"):
        gemv(x, torch.ones(8, 16, device=device))
    with pytest.raises(ValueError, match="weight .* must match x"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="weight must be contiguous"):
        gemv(x, torch.ones(32, 8, device=device).t())
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.empty(2, 9, device=device))
    with pytest.raises(ValueError, match="residual must be"):
        gemv(x, w, residual=torch.empty(2, 8, device=device).half())
    with pytest.raises(ValueError, match="weight rows 8 must split into x's 3 groups"):
        grouped_gemv(torch.ones(2, 3, 32, device=device), w)
    with pytest.raises(ValueError, match="block_n=24"):
        GemvConfig(24, 32, 1, False, 4, 1)
    with pytest.raises(ValueError, match="use_dot needs"):
        GemvConfig(8, 32, 1, True, 4, 1)
    with pytest.raises(ValueError, match="grouped_linear: x must be \\[T, 4, Kg\\]"):
        backend.grouped_linear(torch.ones(2, 3, 32, device=device), w, 4)


def test_backend_dispatch(monkeypatch, device):
    """Up to 16 rows (leading dims flattened) take the kernel, more take F.linear; both
    backends agree, residual included; the layers' outputs too."""
    calls = []
    kernel = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda x, *a, **kw: calls.append(x.shape[0]) or kernel(x, *a, **kw))
    lin = Linear(48, 40).to(device)
    grouped = GroupedLinear(32, 3 * 24, 3).to(device)
    with torch.no_grad():
        lin.weight.copy_(rand(40, 48, seed=7))
        grouped.weight.copy_(rand(72, 32, seed=8))
    xs = [rand(2, 3, 48, seed=9, device=device), rand(17, 48, seed=10, device=device)]
    xg = rand(4, 3, 32, seed=11, device=device)
    residual = rand(6, 40, seed=12, device=device)
    results = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", name)
        with torch.no_grad():
            results[name] = [lin(x) for x in xs] + [grouped(xg),
                                                    backend.linear(xs[0].view(6, 48), lin.weight, residual)]
    assert calls == [6, 6]                     # the 17-row input went to F.linear; grouped is its own kernel
    for got, want in zip(results["triton"], results["torch"]):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_shared_expert_across_backends(monkeypatch, device):
    """The fused gate_up projection and the down projection with the routed experts' output
    as its residual, through the GEMV (triton) and through F.linear / addmm (torch)."""
    expert = DeepseekV4SharedExpert(32, 48, swiglu_limit=2.0).to(device)
    with torch.no_grad():
        for i, p in enumerate(expert.parameters()):
            p.copy_(rand(*p.shape, seed=20 + i) / p.shape[1] ** 0.5)
    expert.fuse_projections()
    x, residual = rand(3, 32, seed=30, device=device), rand(3, 32, seed=31, device=device)
    results = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", name)
        with torch.no_grad():
            results[name] = (expert(x), expert(x, residual=residual))
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(results["torch"][1], results["torch"][0] + residual, **TOL[torch.float32])


def test_linear_keeps_nn_linear_parameters():
    lin = Linear(48, 40)
    assert isinstance(lin, torch.nn.Linear) and lin.bias is None
    assert list(lin.state_dict()) == list(torch.nn.Linear(48, 40, bias=False).state_dict()) == ["weight"]


# DeepSeek-V4-Flash projections (bf16; K in, N out) and the grouped o_a (G 8, Kg 4096, Ng 1024).
V4_SHAPES = [("q_b", 1024, 32768), ("input_proj", 4096, 7168), ("o_b", 8192, 4096),
             ("shared gate_up", 4096, 4096), ("shared down", 2048, 4096), ("compressor", 4096, 1024)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("name,k,n", V4_SHAPES)
def test_gemv_gpu_shapes(name, k, n, m):
    """Against cuBLAS in float32 from the same bf16 inputs; no host sync; bitwise repeatable;
    a CUDA graph replay on new x gives the eager result."""
    x = rand(m, k, seed=k + m, dtype=torch.bfloat16, device="cuda")
    w = rand(n, k, seed=n, dtype=torch.bfloat16, device="cuda") / k ** 0.5
    gemv(x, w)                                  # compiles, allocates the counters
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = gemv(x, w)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.float(), expected(x, w), rtol=1.6e-2, atol=1e-2)
    assert torch.equal(gemv(x, w), out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = gemv(x, w)
    x.copy_(rand(m, k, seed=k + m + 1, dtype=torch.bfloat16, device="cuda"))
    graph.replay()
    assert torch.equal(replayed, gemv(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 16])
def test_grouped_gemv_gpu_shapes(m):
    x = rand(m, 8, 4096, seed=m, dtype=torch.bfloat16, device="cuda")
    w = rand(8 * 1024, 4096, seed=1, dtype=torch.bfloat16, device="cuda") / 64
    out = grouped_gemv(x, w)
    torch.testing.assert_close(out.float(), reference.grouped_gemv(x.float(), w.float()), rtol=1.6e-2, atol=1e-2)
    assert torch.equal(grouped_gemv(x, w), out)
