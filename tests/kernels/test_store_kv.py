"""The Triton KV-cache store against reference.store_kv, into strided layer views of
a shared page buffer laid out as runner/model_runner.py's allocate_kv_cache does."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.store_kv import store_kv


def layer_view(buffer: torch.Tensor, offset: int, bs: int, nt: int, hkv: int, d: int) -> torch.Tensor:
    """One layer's [NB, bs, nt, Hkv, D] view into a [NB, page_elems] buffer shared by layers."""
    n = bs * nt * hkv * d
    return buffer[:, offset:offset + n].view(buffer.shape[0], bs, nt, hkv, d)


@pytest.mark.parametrize("bs,nt,hkv,d", [(4, 2, 2, 8), (16, 2, 3, 24), (8, 1, 1, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_reference(bs, nt, hkv, d, dtype, device):
    gen = torch.Generator().manual_seed(0)
    nb, t = 6, 11
    n = bs * nt * hkv * d
    # A page holds this layer between two other layers' parts, which must stay untouched.
    buffer = torch.full((nb, 3 * n + 5), float("nan"), dtype=dtype, device=device)
    cache = layer_view(buffer, n + 5, bs, nt, hkv, d)
    expected = cache.clone()
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[[2, 7]] = -1                                   # tokens with nothing to store
    tensors = [torch.randn(t, hkv, d, generator=gen).to(dtype).to(device) for _ in range(nt)]
    slots = slots.to(device)
    store_kv(cache, slots, *tensors)
    keep = slots >= 0
    reference.store_kv(expected, slots[keep], *[x[keep] for x in tensors])
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    assert buffer[:, :n + 5].isnan().all() and buffer[:, 2 * n + 5:].isnan().all()
    written = (~cache.isnan()).sum().item()
    assert written == int(keep.sum()) * nt * hkv * d


def test_store_kv_casts_to_the_cache_dtype(device):
    """float32 K/V into a bfloat16 cache, with strided token rows (a slice of a fused buffer)."""
    gen = torch.Generator().manual_seed(1)
    bs, hkv, d, t = 4, 2, 16, 5
    cache = torch.full((3, bs, 2, hkv, d), float("nan"), dtype=torch.bfloat16, device=device)
    expected = cache.clone()
    kv = torch.randn(t, 3 * hkv * d, generator=gen).to(device)
    k = kv[:, :hkv * d].view(t, hkv, d)
    v = kv[:, hkv * d:2 * hkv * d].view(t, hkv, d)
    slots = torch.tensor([0, 5, 6, 11, 3], device=device)
    store_kv(cache, slots, k, v)
    reference.store_kv(expected, slots, k, v)
    # One bfloat16 ulp: the CPU interpreter truncates where torch rounds to nearest.
    torch.testing.assert_close(cache, expected, rtol=8e-3, atol=1e-6, equal_nan=True)


def test_store_kv_rejects_a_tensor_count_mismatch(device):
    cache = torch.zeros(2, 4, 2, 1, 8, device=device)
    with pytest.raises(ValueError, match="holds 2 tensors"):
        store_kv(cache, torch.tensor([0], device=device), torch.zeros(1, 1, 8, device=device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [64, 8192])
def test_store_kv_gpu_sizes(t):
    bs, hkv, d, nb, layers = 16, 8, 128, 2048, 3
    n = bs * 2 * hkv * d
    buffer = torch.full((nb, layers * n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cache = layer_view(buffer, n, bs, 2, hkv, d)
    expected = cache.clone()
    slots = torch.randperm(nb * bs, device="cuda")[:t]
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    store_kv(cache, slots, k, v)
    reference.store_kv(expected, slots, k, v)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    assert buffer[:, :n].isnan().all() and buffer[:, 2 * n:].isnan().all()
