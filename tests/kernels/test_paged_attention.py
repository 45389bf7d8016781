"""Paged attention references against dense causal attention on random data."""

import pytest
import torch

from deepinfer.kernels import reference


def build_cache(lens, bs, hkv, d, gen):
    """A shuffled paged cache holding random K/V for sequences of ``lens`` tokens."""
    need = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(need) + 1, generator=gen)[:sum(need)] + 1  # never block 0
    cache = torch.randn(sum(need) + 2, bs, 2, hkv, d, generator=gen)
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n].tolist())
        i += n
    width = max(need)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return cache, table


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_matches_dense(window, with_sinks):
    gen = torch.Generator().manual_seed(0)
    bs, hq, hkv, d = 4, 6, 2, 8
    lens = [9, 1, 17, 6]
    q_lens = [1, 1, 5, 1]   # decodes (batched path) and a chunk (per-sequence path)
    cache, table = build_cache(lens, bs, hkv, d, gen)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    sinks = torch.randn(hq, generator=gen) if with_sinks else None
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    out = reference.paged_attention(q, cache, table, starts, lens, 0.3, window, sinks)
    for b, n in enumerate(lens):
        kv = reference.gather_kv(cache, table[b], 0, n)
        pos = torch.arange(n)
        s, e = starts[b], starts[b + 1]
        ref = reference.causal_attention(q[s:e], kv[:, 0], kv[:, 1], pos[n - (e - s):], pos, 0.3,
                                         window, sinks)
        torch.testing.assert_close(out[s:e], ref, rtol=1e-5, atol=1e-5)


def test_store_kv_writes_the_slots():
    gen = torch.Generator().manual_seed(1)
    cache = torch.full((5, 4, 2, 2, 3), float("nan"))
    k, v = torch.randn(3, 2, 3, generator=gen), torch.randn(3, 2, 3, generator=gen)
    slots = torch.tensor([6, 7, 17])
    reference.store_kv(cache, slots, k, v)
    torch.testing.assert_close(cache[1, 2, 0], k[0])
    torch.testing.assert_close(cache[1, 3, 1], v[1])
    torch.testing.assert_close(cache[4, 1, 0], k[2])
    assert torch.isnan(cache).sum() == cache.numel() - 3 * 2 * 2 * 3
