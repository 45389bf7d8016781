"""The DeepSeek-V4 fused norm + interleaved-rope kernels against their references
(reference.q_norm_rope / kv_norm_rope / interleaved_rope) on random data."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import backend, reference
from deepinfer.kernels.deepseek_v4_rope import interleaved_rope_, kv_norm_rope, q_norm_rope
from deepinfer.layers.deepseek_v4_common import default_inv_freq, yarn_inv_freq

# float16/bfloat16: a few roundings per output, each up to one ulp off where the CPU
# interpreter truncates instead of rounding (and the norm factor may differ by an ulp).
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.float16: {"rtol": 2e-3, "atol": 2e-3},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 2e-2}}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6


def rope_params(rot: int, yarn: bool) -> tuple[torch.Tensor, float]:
    """(inv_freq [R/2] float32, scaling): V4's compress rope (YaRN, mscale != 1) or a plain one."""
    if yarn:
        return yarn_inv_freq(rot, 160000.0, 16.0, 64, 32, 1), 1.277
    return default_inv_freq(rot, 10000.0), 1.0


def positions(t: int, gen: torch.Generator, device) -> torch.Tensor:
    """Random positions [T] with 0 and large ones (up to ~1e6 radians of angle) among them."""
    pos = torch.randint(0, 1 << 20, (t,), generator=gen)
    pos[0] = 0
    return pos.to(device)


# (T, H, D, R): one head; R < D; R = D (no unrotated channels); H past one head block (8 at D=512).
SHAPES = [(1, 1, 16, 4), (5, 3, 32, 8), (3, 2, 24, 24), (2, 9, 512, 64)]


@pytest.mark.parametrize("t,h,d,rot", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("yarn", [False, True])
def test_q_norm_rope_matches_reference(t, h, d, rot, dtype, yarn, device, poison_empty):
    gen = torch.Generator().manual_seed(t * 100 + d)
    q = (torch.randn(t, h, d, generator=gen) * 3).to(dtype).to(device)
    pos = positions(t, gen, device)
    inv_freq, scaling = rope_params(rot, yarn)
    inv_freq = inv_freq.to(device)
    before = q.clone()
    out = q_norm_rope(q, pos, inv_freq, scaling, EPS)
    torch.testing.assert_close(out, reference.q_norm_rope(q, pos, inv_freq, scaling, EPS), **TOL[dtype])
    assert torch.equal(q, before)                                        # out of place


def shared_pages(nb: int, bs: int, d: int, dtype, gen: torch.Generator, device) -> torch.Tensor:
    """A middle layer's [NB, bs, 2, 1, D] cache: a strided view into pages of 3 layers, random."""
    n = bs * 2 * d
    pages = torch.randn(nb, 3 * n, generator=gen).to(dtype).to(device)
    return pages[:, n:2 * n].view(nb, bs, 2, 1, d)


@pytest.mark.parametrize("t,d,rot", [(1, 16, 4), (6, 32, 8), (4, 24, 24), (3, 512, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_kv_norm_rope_matches_reference_and_stores(t, d, rot, dtype, slot_dtype, device, poison_empty):
    gen = torch.Generator().manual_seed(t * 10 + d)
    kv = (torch.randn(t, d, generator=gen) * 2).to(dtype).to(device)
    weight = torch.randn(d, generator=gen).to(device)
    pos = positions(t, gen, device)
    inv_freq, scaling = rope_params(rot, yarn=True)
    inv_freq = inv_freq.to(device)
    bs = 4
    cache = shared_pages(t + 2, bs, d, dtype, gen, device)
    # Distinct shuffled slots; token 1 (when there is one) stores nothing.
    slots = torch.randperm((t + 2) * bs, generator=gen)[:t]
    if t > 1:
        slots[1] = -1
    slots = slots.to(slot_dtype).to(device)
    expected_cache = cache.clone()
    expected = reference.kv_norm_rope(kv, weight, pos, inv_freq, scaling, EPS, expected_cache, slots)
    out = kv_norm_rope(kv, weight, pos, inv_freq, scaling, EPS, cache, slots)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    torch.testing.assert_close(cache, expected_cache, **TOL[dtype])
    # Tensor 1 of every entry and all unwritten slots are left exactly as they were.
    written = slots[slots >= 0].long()
    untouched = torch.ones((t + 2) * bs, dtype=torch.bool, device=device)
    untouched[written] = False
    flat, flat_expected = cache.flatten(0, 1), expected_cache.flatten(0, 1)
    assert torch.equal(flat[untouched], flat_expected[untouched])
    assert torch.equal(flat[:, 1], flat_expected[:, 1])
    # Without a cache: the same rows.
    torch.testing.assert_close(kv_norm_rope(kv, weight, pos, inv_freq, scaling, EPS), expected, **TOL[dtype])


@pytest.mark.parametrize("t,h,d,rot", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_interleaved_rope_in_place_on_a_strided_view(t, h, d, rot, dtype, inverse, device):
    """x as heads [:h] of a wider buffer: the rest of the buffer must stay untouched."""
    gen = torch.Generator().manual_seed(t + h + d)
    buffer = torch.randn(t, h + 1, d, generator=gen).to(dtype).to(device)
    x = buffer[:, :h]
    pos = positions(t, gen, device)
    inv_freq, scaling = rope_params(rot, yarn=True)
    inv_freq = inv_freq.to(device)
    expected = reference.interleaved_rope(x, pos, inv_freq, scaling, inverse)
    spare = buffer[:, h].clone()
    assert interleaved_rope_(x, pos, inv_freq, scaling, inverse).data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, expected, **TOL[dtype])
    assert torch.equal(buffer[:, h], spare)


def test_inverse_rope_undoes_the_rope(device):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, 32, generator=gen).to(device)
    pos = positions(4, gen, device)
    inv_freq = default_inv_freq(8, 10000.0).to(device)
    y = interleaved_rope_(x.clone(), pos, inv_freq, 1.0)
    assert not torch.allclose(y, x)
    torch.testing.assert_close(interleaved_rope_(y, pos, inv_freq, 1.0, inverse=True), x,
                               rtol=1e-5, atol=1e-5)


# token blocks of 1 and (from 2048 tokens, ~19 s in the interpreter: slow) of 4, with a tail
@pytest.mark.parametrize("t", [7, pytest.param(2051, marks=pytest.mark.slow)])
def test_rope_only_kernel_matches_the_strided_kernel(t, device):
    """interleaved_rope_ takes the contiguous-tile kernel at power-of-two rope widths; it must
    give the norm kernel's rope-only variant's values (strided halves): the same bits in the
    interpreter, and on a GPU up to the compiler fusing a multiply-add differently (a bf16 ulp)."""
    from deepinfer.kernels import deepseek_v4_rope as k
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, 5, 48, generator=gen).to(torch.bfloat16).to(device)
    pos = positions(t, gen, device)
    inv_freq, scaling = rope_params(16, yarn=True)
    inv_freq = inv_freq.to(device)
    strided = x.clone()
    k._launch(strided, strided, pos, inv_freq, scaling, True, k.NO_NORM, 0.0, None, None, None, "test")
    fast = interleaved_rope_(x.clone(), pos, inv_freq, scaling, inverse=True)
    assert not torch.equal(fast, x)
    if device.type == "cpu":
        assert torch.equal(fast, strided)
    else:
        torch.testing.assert_close(fast, strided, rtol=8e-3, atol=8e-3)


def test_empty_batch(device):
    inv_freq = default_inv_freq(4, 10000.0).to(device)
    empty = torch.empty(0, dtype=torch.long, device=device)
    assert q_norm_rope(torch.randn(0, 2, 8, device=device), empty, inv_freq, 1.0, EPS).shape == (0, 2, 8)
    assert kv_norm_rope(torch.randn(0, 8, device=device), torch.ones(8, device=device), empty, inv_freq,
                        1.0, EPS).shape == (0, 8)


def test_launchers_reject_bad_arguments(device):
    q = torch.randn(2, 2, 8, device=device)
    pos = torch.zeros(2, dtype=torch.long, device=device)
    inv_freq = default_inv_freq(4, 10000.0).to(device)
    with pytest.raises(ValueError, match="inv_freq"):
        q_norm_rope(q, pos, inv_freq.double(), 1.0, EPS)
    with pytest.raises(ValueError, match="inv_freq"):
        q_norm_rope(q, pos, default_inv_freq(10, 10000.0).to(device), 1.0, EPS)   # R = 10 > D = 8
    with pytest.raises(ValueError, match="positions"):
        q_norm_rope(q, pos.float(), inv_freq, 1.0, EPS)
    with pytest.raises(ValueError, match="weight"):
        kv_norm_rope(q[:, 0], torch.ones(8, dtype=torch.bfloat16, device=device), pos, inv_freq, 1.0, EPS)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_norm_rope(q[:, 0], torch.ones(8, device=device), pos, inv_freq, 1.0, EPS,
                     torch.zeros(2, 2, 1, 1, 8, device=device), None)


def test_backend_picks_the_kernel(monkeypatch, device):
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(3, 2, 16, generator=gen).to(device)
    pos = positions(3, gen, device)
    inv_freq, scaling = rope_params(8, yarn=True)
    inv_freq = inv_freq.to(device)
    results = {}
    for choice in ("torch", "triton"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", choice)
        results[choice] = (backend.q_norm_rope(q, pos, inv_freq, scaling, EPS),
                           backend.interleaved_rope(q.clone(), pos, inv_freq, scaling, inverse=True),
                           backend.kv_norm_rope(q[:, 0].contiguous(), torch.ones(16, device=device), pos,
                                                inv_freq, scaling, EPS))
    for got, want in zip(results["triton"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [1, 16, 4096])
@pytest.mark.parametrize("h,d,rot", [(64, 512, 64), (64, 128, 64)])   # V4-Flash queries; indexer queries
def test_real_shapes_on_gpu(t, h, d, rot):
    gen = torch.Generator().manual_seed(t)
    dtype = torch.bfloat16
    q = torch.randn(t, h, d, generator=gen).to(dtype).cuda()
    pos = positions(t, gen, "cuda")
    inv_freq, scaling = rope_params(rot, yarn=True)
    inv_freq = inv_freq.cuda()
    tol = TOL[dtype]     # a bfloat16 ulp or two where the norm factor rounds differently
    torch.testing.assert_close(q_norm_rope(q, pos, inv_freq, scaling, EPS),
                               reference.q_norm_rope(q, pos, inv_freq, scaling, EPS), **tol)
    expected = reference.interleaved_rope(q, pos, inv_freq, scaling, inverse=True)
    torch.testing.assert_close(interleaved_rope_(q.clone(), pos, inv_freq, scaling, inverse=True),
                               expected, **tol)
    kv = q[:, 0].contiguous()
    weight = torch.randn(d, generator=gen).cuda()
    cache = shared_pages(t // 16 + 2, 16, d, dtype, gen, "cuda")
    slots = torch.randperm((t // 16 + 2) * 16, generator=gen)[:t].cuda()
    expected_cache = cache.clone()
    expected = reference.kv_norm_rope(kv, weight, pos, inv_freq, scaling, EPS, expected_cache, slots)
    torch.testing.assert_close(kv_norm_rope(kv, weight, pos, inv_freq, scaling, EPS, cache, slots),
                               expected, **tol)
    torch.testing.assert_close(cache, expected_cache, **tol)
