"""The Triton router-logits kernels against reference.router_logits on random data.

Both sides accumulate in float32 (bf16/fp16 x is exact in float32), so they differ only
in summation order: a relative tolerance of 1e-5 of the logits' scale.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.router import RouterConfig, pick_config, router_logits
from deepinfer.layers.deepseek_v4_moe import DeepseekV4Router
from deepinfer.models.deepseek_v3 import MoEArgs, NoAuxTCRouter


def make_inputs(t: int, e: int, h: int, dtype: torch.dtype, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=gen) * 2).to(dtype).to(device)
    weight = (torch.randn(e, h, generator=gen) / h ** 0.5).to(device)
    return x, weight


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("t", [1, 3, 16, 17, 64, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_router_logits_matches_reference(t, dtype, device, poison_empty):
    """E=41 is no multiple of any expert block, H=200 none of any K step; T up to 16 takes
    the FMA kernel, above it the tl.dot one."""
    x, weight = make_inputs(t, 41, 200, dtype, device, seed=t)
    assert pick_config(t, 41, 200, x.device).dot == (t > 16)
    assert_matches(router_logits(x, weight), reference.router_logits(x, weight))


FMA = RouterConfig(False, 4, 2, 64, 1, 4, 3)
DOT = RouterConfig(True, 16, 16, 32, 1, 4, 2)


@pytest.mark.parametrize("cfg", [
    FMA, FMA._replace(split_k=3), FMA._replace(block_t=1, block_e=4, split_k=2),
    DOT, DOT._replace(split_k=3), DOT._replace(block_t=32, block_e=32, block_k=64, split_k=2),
])
@pytest.mark.parametrize("h", [256, 300])
def test_router_logits_configs(cfg, h, device, poison_empty):
    """Token blocks smaller than T, splits along H (summed by the second launch), H a multiple
    of the K step (no column masks) or not."""
    x, weight = make_inputs(9 if not cfg.dot else 37, 23, h, torch.bfloat16, device, seed=h)
    assert_matches(router_logits(x, weight, cfg), reference.router_logits(x, weight))


@pytest.mark.parametrize("t", [3, 64])
def test_router_logits_default_splits(t, device, poison_empty):
    """When the tiles alone are few, pick_config splits H."""
    x, weight = make_inputs(t, 6, 1024, torch.bfloat16, device, seed=5)
    assert pick_config(t, 6, 1024, x.device).split_k > 1
    assert_matches(router_logits(x, weight), reference.router_logits(x, weight))


@pytest.mark.parametrize("cfg", [FMA._replace(split_k=3), DOT._replace(split_k=3)])
def test_router_logits_deterministic(cfg, device):
    x, weight = make_inputs(20, 23, 300, torch.bfloat16, device, seed=3)
    assert torch.equal(router_logits(x, weight, cfg), router_logits(x, weight, cfg))


def test_router_logits_strided_rows(device):
    """x a column slice of a wider buffer (row stride > H)."""
    x, weight = make_inputs(5, 12, 96, torch.bfloat16, device)
    buf = torch.randn(5, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16).to(device)
    buf[:, 16:112] = x
    view = buf[:, 16:112]
    assert view.stride(0) == 128
    assert_matches(router_logits(view, weight), reference.router_logits(x, weight))


def test_router_logits_rejects_bad_inputs(device):
    x, weight = make_inputs(3, 8, 32, torch.bfloat16, device)
    with pytest.raises(ValueError, match="x must be"):
        router_logits(x[None], weight)
    with pytest.raises(ValueError, match="weight has shape"):
        router_logits(x, weight[:, :16])
    with pytest.raises(ValueError, match="weight must be float32"):
        router_logits(x, weight.bfloat16())
    with pytest.raises(ValueError, match="x must be bfloat16, float16 or float32"):
        router_logits(x.double(), weight)
    with pytest.raises(ValueError, match="x must have unit stride"):
        router_logits(torch.randn(32, 3, device=device).t(), weight)
    with pytest.raises(ValueError, match="weight must have unit stride"):
        router_logits(x, torch.randn(32, 8, device=device).t())


def test_router_logits_empty(device):
    x, weight = make_inputs(0, 8, 32, torch.bfloat16, device)
    assert router_logits(x, weight).shape == (0, 8)


def test_routers_match_across_backends(device, monkeypatch):
    """Both DeepSeek routers compute their logits through backend.router_logits."""
    gen = torch.Generator().manual_seed(7)
    h, e, t = 64, 16, 5
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
    v4 = DeepseekV4Router(h, e, 4, "sqrtsoftplus", 1.5, None).to(device)
    v3 = NoAuxTCRouter(MoEArgs(hidden_size=h, num_experts=e, num_shared_experts=1, top_k=4, num_groups=4,
                               topk_groups=2, intermediate_size=32, renormalize=True,
                               routed_scaling_factor=2.5, hidden_act="silu")).to(device)
    with torch.no_grad():
        for router in (v4, v3):
            router.weight.copy_(torch.randn(e, h, generator=gen) / h ** 0.5)

    def run():
        return v4(x, None), v3(x)

    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "torch")
    want = run()
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    got = run()
    for (w_a, ids_a), (w_b, ids_b) in zip(got, want):
        ids_a, order_a = ids_a.sort(-1)
        ids_b, order_b = ids_b.sort(-1)
        assert torch.equal(ids_a, ids_b)
        torch.testing.assert_close(w_a.gather(1, order_a), w_b.gather(1, order_b), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 16, 64, 4096])
def test_router_logits_gpu_v4_sizes(t, poison_empty):
    """V4-Flash widths: E=256, H=4096, bf16 x (T=4096: tf32x3 tensor-core tiles)."""
    x, weight = make_inputs(t, 256, 4096, torch.bfloat16, "cuda", seed=t)
    out = router_logits(x, weight)
    assert_matches(out, reference.router_logits(x, weight))
    assert torch.equal(out, router_logits(x, weight))
