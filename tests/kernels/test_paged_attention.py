"""Paged attention on random data: the references against dense causal attention, and the
Triton kernels against the references."""

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.paged_attention import paged_attention as triton_paged_attention
from deepinfer.kernels.paged_attention import paged_decode_attention as triton_paged_decode


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


# --- Triton kernels (deepinfer/kernels/paged_attention.py) against the references --------------

# float16 stands in for bfloat16 on the CPU: the interpreter cannot multiply bfloat16 tiles.
KERNEL_TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5},
              torch.float16: {"rtol": 2e-3, "atol": 2e-3},
              torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2}}


def build_layer_cache(lens, first_needed, bs, hkv, d, dtype, device, gen):
    """A layer's paged cache as a strided view into a page buffer shared with another layer.

    Sequence b's positions ``first_needed[b] .. lens[b] - 1`` hold random K/V in shuffled
    blocks; everything a kernel must not read is NaN: the other layer's half of each page,
    the null block 0 (which the table holds for blocks wholly before ``first_needed``, as
    for blocks that left a sliding window) and the slots past each sequence's end.
    """
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 2
    n = bs * 2 * hkv * d
    buffer = torch.full((nb, 2 * n), float("nan"), dtype=dtype)
    cache = buffer[:, n:].view(nb, bs, 2, hkv, d)
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    rows = []
    for b, L in enumerate(lens):
        row = []
        for j in range(need[b]):
            if (j + 1) * bs <= first_needed[b]:
                row.append(0)
                continue
            blk = perm.pop()
            row.append(blk)
            used = min(bs, L - j * bs)
            cache[blk, :used] = torch.randn(used, 2, hkv, d, generator=gen).to(dtype)
        rows.append(row)
    width = max(need)
    table = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
    return buffer.to(device)[:, n:].view(nb, bs, 2, hkv, d), table.to(device)


def starts_of(q_lens):
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return starts


DECODE_CASES = [
    # bs, hq, hkv, d, lens, num_splits, window, sinks, dtype
    (4, 6, 2, 16, [9, 1, 17, 6, 70], 3, None, False, torch.float32),
    (4, 6, 2, 16, [9, 1, 17, 6, 70], 2, 5, True, torch.float32),
    (16, 8, 8, 32, [100, 33], 1, 40, True, torch.float16),
    (8, 16, 1, 24, [50, 3, 129], 4, None, False, torch.float16),
]


@pytest.mark.parametrize("bs,hq,hkv,d,lens,num_splits,window,with_sinks,dtype", DECODE_CASES)
def test_triton_paged_decode_matches_reference(bs, hq, hkv, d, lens, num_splits, window, with_sinks,
                                               dtype, device, poison_empty):
    gen = torch.Generator().manual_seed(0)
    first = [0 if window is None else max(0, n - window) for n in lens]
    cache, table = build_layer_cache(lens, first, bs, hkv, d, dtype, device, gen)
    q = (torch.randn(len(lens), hq, d, generator=gen) * 2).to(dtype).to(device)
    sinks = torch.randn(hq, generator=gen).to(device) if with_sinks else None
    lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
    out = triton_paged_decode(q, cache, table, lens_t, max(lens), 0.25, window, sinks,
                              num_splits=num_splits)
    ref = reference.paged_decode_attention(q, cache, table, lens, 0.25, window, sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])


@pytest.mark.parametrize("window", [None, 6])
def test_triton_paged_decode_graph_shapes(window, device, poison_empty):
    """As a CUDA graph runs it: max_seq_len is a loose bound (many splits, most of them
    empty for short rows) and padding rows (length 1 over a null-block table row) sit
    beside real ones; real rows match the reference, padding rows stay finite."""
    gen = torch.Generator().manual_seed(4)
    bs, hq, hkv, d, dtype = 4, 4, 2, 16, torch.float32
    lens = [13, 2, 30]
    first = [0 if window is None else max(0, n - window) for n in lens]
    cache, table = build_layer_cache(lens, first, bs, hkv, d, dtype, device, gen)
    cache[0] = 0.0                      # the null block is never written: zeros
    pad = 2
    table = torch.cat([table, torch.zeros(pad, table.shape[1], dtype=table.dtype, device=device)])
    q = (torch.randn(len(lens) + pad, hq, d, generator=gen) * 2).to(dtype).to(device)
    lens_t = torch.tensor(lens + [1] * pad, dtype=torch.int32, device=device)
    out = triton_paged_decode(q, cache, table, lens_t, 1024, 0.25, window, num_splits=5)
    ref = reference.paged_decode_attention(q[:len(lens)], cache, table[:len(lens)], lens, 0.25, window)
    torch.testing.assert_close(out[:len(lens)], ref, **KERNEL_TOL[dtype])
    assert torch.isfinite(out[len(lens):]).all()


def test_triton_paged_decode_rejects_host_lengths(device):
    cache = torch.zeros(2, 4, 2, 1, 16, device=device)
    q = torch.zeros(1, 2, 16, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="seq_lens must be"):
        triton_paged_decode(q, cache, table, torch.tensor([1]), 1, 1.0)


PREFILL_CASES = [
    # bs, hq, hkv, d, q_lens, lens, window, sinks, dtype
    (4, 6, 2, 16, [1, 1, 5, 6, 30], [9, 1, 17, 6, 70], None, False, torch.float32),
    (4, 6, 2, 16, [1, 1, 5, 6, 30], [9, 1, 17, 6, 70], 5, True, torch.float32),
    (16, 4, 4, 32, [40, 3, 1], [100, 3, 20], 16, False, torch.float16),
    (8, 16, 1, 24, [7, 70], [7, 90], None, True, torch.float16),
    (4, 8, 2, 16, [1, 1, 1], [5, 40, 9], 8, True, torch.float32),      # all decode: dispatches
]


@pytest.mark.parametrize("bs,hq,hkv,d,q_lens,lens,window,with_sinks,dtype", PREFILL_CASES)
def test_triton_paged_attention_matches_reference(bs, hq, hkv, d, q_lens, lens, window, with_sinks,
                                                  dtype, device, poison_empty):
    gen = torch.Generator().manual_seed(1)
    first = [0 if window is None else max(0, L - n - window + 1) for n, L in zip(q_lens, lens)]
    cache, table = build_layer_cache(lens, first, bs, hkv, d, dtype, device, gen)
    starts = starts_of(q_lens)
    q = (torch.randn(starts[-1], hq, d, generator=gen) * 2).to(dtype).to(device)
    sinks = torch.randn(hq, generator=gen).to(device) if with_sinks else None
    out = triton_paged_attention(q, cache, table, starts, lens, 0.25, window, sinks)
    ref = reference.paged_attention(q, cache, table, starts, lens, 0.25, window, sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])


def test_triton_paged_attention_rejects_a_dtype_mismatch(device):
    cache = torch.zeros(2, 4, 2, 1, 16, device=device)
    q = torch.zeros(1, 2, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="cache is"):
        triton_paged_attention(q, cache, torch.zeros(1, 1, dtype=torch.int32, device=device),
                               [0, 1], [1], 1.0)


GPU_DECODE_CASES = [
    # batch, context, hq, hkv, d, bs, window, sinks, dtype
    (64, 4096, 32, 8, 128, 16, None, False, torch.bfloat16),
    (3, 8000, 64, 8, 128, 16, 1024, True, torch.bfloat16),
    (8, 1000, 32, 8, 128, 16, None, True, torch.float32),
    (16, 2048, 16, 2, 64, 32, None, False, torch.bfloat16),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch,ctx,hq,hkv,d,bs,window,with_sinks,dtype", GPU_DECODE_CASES)
def test_triton_paged_decode_gpu_sizes(batch, ctx, hq, hkv, d, bs, window, with_sinks, dtype,
                                       poison_empty):
    gen = torch.Generator().manual_seed(2)
    lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen).tolist()
    first = [0 if window is None else max(0, n - window) for n in lens]
    cache, table = build_layer_cache(lens, first, bs, hkv, d, dtype, torch.device("cuda"), gen)
    q = (torch.randn(batch, hq, d, generator=gen) * 2).to("cuda", dtype)
    sinks = torch.randn(hq, generator=gen).to("cuda") if with_sinks else None
    starts = list(range(batch + 1))
    out = triton_paged_attention(q, cache, table, starts, lens, d ** -0.5, window, sinks)
    ref = reference.paged_decode_attention(q, cache, table, lens, d ** -0.5, window, sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])


GPU_PREFILL_CASES = [
    # q_lens, contexts, hq, hkv, d, bs, window, sinks, dtype
    ([2048, 512, 1, 1], [2048, 3000, 4096, 17], 32, 8, 128, 16, None, False, torch.bfloat16),
    ([1000, 300], [1000, 5000], 64, 8, 128, 16, 512, True, torch.bfloat16),
    ([300, 1], [700, 300], 16, 4, 64, 16, None, True, torch.float32),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("q_lens,lens,hq,hkv,d,bs,window,with_sinks,dtype", GPU_PREFILL_CASES)
def test_triton_paged_prefill_gpu_sizes(q_lens, lens, hq, hkv, d, bs, window, with_sinks, dtype,
                                        poison_empty):
    gen = torch.Generator().manual_seed(3)
    first = [0 if window is None else max(0, L - n - window + 1) for n, L in zip(q_lens, lens)]
    cache, table = build_layer_cache(lens, first, bs, hkv, d, dtype, torch.device("cuda"), gen)
    starts = starts_of(q_lens)
    q = (torch.randn(starts[-1], hq, d, generator=gen) * 2).to("cuda", dtype)
    sinks = torch.randn(hq, generator=gen).to("cuda") if with_sinks else None
    out = triton_paged_attention(q, cache, table, starts, lens, d ** -0.5, window, sinks)
    ref = reference.paged_attention(q, cache, table, starts, lens, d ** -0.5, window, sinks)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])


def test_attention_layer_decode_only_path(monkeypatch, device):
    """The layer's graph-safe decode path (device lengths, a loose max_seq_len, a padding row)
    gives the general path's result through either backend, and stores nothing for slot -1."""
    from deepinfer.forward_context import ForwardContext, GroupMetadata
    from deepinfer.layers.attention import Attention

    gen = torch.Generator().manual_seed(6)
    hq, hkv, d, bs = 4, 2, 16, 4
    cache0 = torch.randn(8, bs, 2, hkv, d, generator=gen)
    cache0[0] = 0.0                                      # the null block
    # Sequences at positions 9 and 2; row 2 is graph padding (seq_len 1, null blocks, slot -1).
    table = torch.tensor([[1, 2, 6], [7, 0, 0], [0, 0, 0]], dtype=torch.int32, device=device)
    slots = torch.tensor([6 * 4 + 1, 7 * 4 + 2, -1], device=device)
    q = torch.randn(3, hq * d, generator=gen).to(device)
    k = torch.randn(3, hkv * d, generator=gen).to(device)
    v = torch.randn(3, hkv * d, generator=gen).to(device)

    def run(decode_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        attn = Attention(hq, hkv, d, scale=0.25, dtype=torch.float32, sliding_window=6)
        attn.kv_cache, attn.group_id = cache0.clone().to(device), 0
        ctx = ForwardContext(positions=torch.tensor([9, 2, 0], device=device),
                             query_start_loc=[0, 1, 2, 3], seq_lens=[10, 3, 1],
                             groups=[GroupMetadata(block_size=bs, block_table=table, slot_mapping=slots)],
                             max_seq_len=64 if decode_only else 0, decode_only=decode_only)
        return attn(q, k, v, ctx), attn.kv_cache

    results = []
    for choice in ("torch", "triton"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", choice)
        results += [run(True), run(False)]
    ref_out, ref_cache = results[1]                      # torch backend, general path
    for out, cache in results:
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, ref_cache)
    assert ref_cache[0].abs().max() == 0                 # padding stored nothing in the null block
