"""The Gluon prefill sparse-attention kernel (deepinfer/kernels/sparse_attention_gluon.py)
against the references on random paged caches. GPU only: Gluon has no CPU interpreter, and
the kernel is built for Hopper (sm_90)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from tests.kernels.paged_sources import page_buffer_caches, random_slots
from tests.kernels.test_sparse_attention import v4_inputs

pytestmark = pytest.mark.gpu

TOL = {"rtol": 2e-2, "atol": 1e-2}


def _need_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.fail("needs a Hopper (sm_90) GPU")


def _rope(t: int, gen: torch.Generator, scaling: float = 1.0, start: int = 0):
    from deepinfer.kernels.sparse_attention_gluon import QueryRope
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    positions = start + torch.randperm(4 * t, generator=gen)[:t]
    return QueryRope(positions.cuda(), inv_freq.cuda(), scaling, 1e-6)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("specs", [[(16, 1, 128)], [(16, 1, 128), (16, 1, 512)], [(16, 1, 70), (8, 2, 33)]])
def test_gluon_sparse_prefill_matches_reference(specs, slot_dtype):
    _need_hopper()
    from deepinfer.kernels.sparse_attention_gluon import sparse_attention_prefill
    gen = torch.Generator().manual_seed(len(specs))
    t, h, d, blocks = 37, 64, 512, 64
    caches = page_buffer_caches(blocks, [(bs, nt, d) for bs, nt, _ in specs], torch.bfloat16, "cuda", gen)
    sources = [(cache, random_slots(t, k, blocks * bs, gen, pad=0.25, empty_rows=(1,), dtype=slot_dtype).cuda())
               for cache, (bs, _, k) in zip(caches, specs)]
    q = (torch.randn(t, h, d, generator=gen) * 2).to(torch.bfloat16).cuda()
    sinks = torch.randn(h, generator=gen).cuda()
    out = sparse_attention_prefill(q, sources, sinks, d ** -0.5)
    ref = reference.sparse_attention(q, sources, sinks, d ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **TOL)
    assert torch.equal(out[1], torch.zeros_like(out[1]))       # row 1 has no key


@pytest.mark.parametrize("two_sources,scaling,start", [(True, 1.0, 0), (False, 1.25, 0), (True, 1.0, 300_000)])
def test_gluon_query_prologue_matches_reference(two_sources, scaling, start):
    """With ``rope`` the kernel takes the raw query projection and applies the q norm + rope
    itself: the result must match attention over ``q_norm_rope(q)`` (reference), and the same
    kernel fed by the Triton ``q_norm_rope`` launch (the same numerics: equal up to rare
    last-bit differences in the normed query)."""
    _need_hopper()
    from deepinfer.kernels import deepseek_v4_rope
    from deepinfer.kernels.sparse_attention_gluon import sparse_attention_prefill
    gen = torch.Generator().manual_seed(7 + start)
    t = 300
    q, sources, sinks = v4_inputs(t, False, torch.bfloat16, gen)
    q = (q * 3 + 0.5).contiguous()                                   # far from unit norm
    sources = sources if two_sources else sources[:1]
    rope = _rope(t, gen, scaling, start)
    out = sparse_attention_prefill(q, sources, sinks, 512 ** -0.5, rope=rope)
    qn_ref = reference.q_norm_rope(q, rope.positions, rope.inv_freq, scaling, rope.eps)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference.sparse_attention(qn_ref, sources, sinks, 512 ** -0.5), **TOL)
    qn = deepseek_v4_rope.q_norm_rope(q, rope.positions, rope.inv_freq, scaling, rope.eps)
    torch.testing.assert_close(out, sparse_attention_prefill(qn, sources, sinks, 512 ** -0.5),
                               rtol=1e-2, atol=2e-3)


def test_rope_attention_dispatch_long_prefill(monkeypatch):
    """At a long prefill chunk ``rope_attention`` takes the fused Gluon kernel; with
    DEEPINFER_GLUON_ATTENTION=0 the three Triton launches. Both match the reference."""
    _need_hopper()
    from deepinfer.kernels import sparse_attention as sa
    gen = torch.Generator().manual_seed(11)
    t = 2048
    q, sources, sinks = v4_inputs(t, False, torch.bfloat16, gen)
    rope = _rope(t, gen)
    args = (q, rope.positions, rope.inv_freq, rope.scaling, rope.eps, sources, sinks, 512 ** -0.5)
    ref = reference.rope_attention(*args)
    monkeypatch.setenv("DEEPINFER_GLUON_ATTENTION", "1")
    assert sa._takes_gluon(q, sources)
    fused = sa.rope_attention(*args)
    monkeypatch.setenv("DEEPINFER_GLUON_ATTENTION", "0")
    assert not sa._takes_gluon(q, sources)
    unfused = sa.rope_attention(*args)
    torch.testing.assert_close(fused, ref, **TOL)
    torch.testing.assert_close(unfused, ref, **TOL)
