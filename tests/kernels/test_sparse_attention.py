"""DeepSeek-V4 sparse attention: the Triton kernel (deepinfer/kernels/sparse_attention.py)
against :func:`reference.sparse_attention` on random data, and the reference against a
direct softmax over the gathered keys."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import backend, reference
from deepinfer.kernels import sparse_attention as sparse_attention_module
from deepinfer.kernels.sparse_attention import SparseAttentionConfig, sparse_attention
from tests.kernels.paged_sources import pad_runs, page_buffer_caches, page_buffer_records, random_slots

# float16 stands in for bfloat16 on the CPU: the interpreter cannot multiply bfloat16 tiles.
KERNEL_TOL = {torch.float32: {"rtol": 1e-4, "atol": 1e-5},
              torch.float16: {"rtol": 2e-3, "atol": 2e-3},
              torch.bfloat16: {"rtol": 2e-2, "atol": 1e-2}}


def make_inputs(t, h, d, specs, dtype, device, gen, num_blocks=12, empty_rows=(1,), pad=0.25,
                slot_dtype=torch.int32):
    """q [t, h, d], sources over caches of ``specs`` = [(bs, nt, K)], sinks [h]."""
    caches = page_buffer_caches(num_blocks, [(bs, nt, d) for bs, nt, _ in specs], dtype, device, gen)
    sources = [(cache, random_slots(t, k, num_blocks * bs, gen, pad, empty_rows, slot_dtype).to(device))
               for cache, (bs, _, k) in zip(caches, specs)]
    q = (torch.randn(t, h, d, generator=gen) * 2).to(dtype).to(device)
    sinks = torch.randn(h, generator=gen).to(device)
    return q, sources, sinks


def test_reference_is_softmax_over_gathered_keys_and_sink():
    gen = torch.Generator().manual_seed(0)
    t, h, d = 3, 2, 8
    q, sources, sinks = make_inputs(t, h, d, [(4, 1, 6), (2, 2, 5)], torch.float32, "cpu", gen)
    out = reference.sparse_attention(q, sources, sinks, 0.3)
    for i in range(t):
        keys = [cache[s // cache.shape[1], s % cache.shape[1], 0, 0]
                for cache, slots in sources for s in slots[i].tolist() if s >= 0]
        if not keys:
            assert torch.equal(out[i], torch.zeros(h, d))
            continue
        kv = torch.stack(keys)                                                   # [k, D]
        logits = torch.cat([q[i] @ kv.t() * 0.3, sinks[:, None]], dim=1)        # [H, k + 1]
        probs = torch.softmax(logits, dim=1)[:, :-1]
        torch.testing.assert_close(out[i], probs @ kv)


CASES = [
    # t, h, d, sources [(bs, nt, K)], dtype, config (block_h, block_n, splits, warps, stages) or None
    (4, 4, 32, [(8, 1, 40)], torch.float32, None),
    (5, 4, 64, [(8, 1, 24), (4, 2, 17)], torch.float32, SparseAttentionConfig(16, 16, 4, 4, 2)),
    (4, 6, 48, [(16, 1, 20), (4, 1, 33)], torch.float16, SparseAttentionConfig(16, 16, 2, 4, 2)),
    (3, 20, 32, [(8, 2, 9), (8, 1, 30)], torch.float16, None),                   # 20 of 32 rows
    (3, 20, 32, [(8, 2, 9), (8, 1, 30)], torch.float32, None),                   # two head blocks
    (4, 4, 32, [(8, 1, 16), (4, 1, 0)], torch.float32, None),                    # empty second source
    (4, 4, 32, [(4, 1, 3), (8, 1, 37)], torch.float32, SparseAttentionConfig(16, 16, 3, 4, 2)),
    (3, 6, 64, [(8, 1, 40), (4, 1, 33)], torch.float16, SparseAttentionConfig(64, 64, 1, 8, 2)),  # prefill tiles
    # H a multiple of BLOCK_H and D a power of two: the unmasked (EVEN) head and dim paths
    (4, 16, 32, [(8, 1, 40), (4, 1, 33)], torch.float16, SparseAttentionConfig(16, 16, 1, 4, 2)),
    (4, 32, 32, [(8, 1, 40), (4, 1, 33)], torch.float32, SparseAttentionConfig(16, 16, 3, 4, 2)),
]


@pytest.mark.parametrize("t,h,d,specs,dtype,config", CASES)
def test_triton_sparse_attention_matches_reference(t, h, d, specs, dtype, config, device, poison_empty):
    gen = torch.Generator().manual_seed(sum(k for _, _, k in specs))
    q, sources, sinks = make_inputs(t, h, d, specs, dtype, device, gen)
    out = sparse_attention(q, sources, sinks, 0.2, config)
    ref = reference.sparse_attention(q, sources, sinks, 0.2)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])
    assert torch.equal(out[1], torch.zeros_like(out[1]))       # row 1 has no key in any source


@pytest.mark.parametrize("max_scan", [1024, 8])
@pytest.mark.parametrize("config", [None, SparseAttentionConfig(16, 16, 3, 4, 2)])
def test_triton_sparse_attention_skips_padding_runs(config, max_scan, device, poison_empty, monkeypatch):
    """Leading and trailing -1 runs (which the kernel trims) of every length, tile-aligned or not,
    found by one load of the slot row or (a scan wider than ``max_scan``) by a loop of loads."""
    monkeypatch.setattr(sparse_attention_module, "_MAX_SCAN", max_scan)
    gen = torch.Generator().manual_seed(9)
    q, sources, sinks = make_inputs(6, 4, 32, [(8, 1, 45), (4, 1, 37)], torch.float32, device, gen,
                                    pad=0.1, empty_rows=())
    sources = [(cache, pad_runs(slots.cpu(), gen).to(device)) for cache, slots in sources]
    sources[0][1][2, :16] = -1                                  # a run ending on a tile boundary
    sources[0][1][2, 32:] = -1
    out = sparse_attention(q, sources, sinks, 0.2, config)
    torch.testing.assert_close(out, reference.sparse_attention(q, sources, sinks, 0.2),
                               **KERNEL_TOL[torch.float32])


def test_triton_sparse_attention_strided_q_and_slots(device, poison_empty):
    """q with a padded head stride and int64 slots read through a column slice."""
    gen = torch.Generator().manual_seed(7)
    t, h, d = 3, 4, 32
    q, sources, sinks = make_inputs(t, h, d, [(8, 1, 24), (4, 1, 10)], torch.float32, device, gen,
                                    slot_dtype=torch.int64)
    q_wide = torch.randn(t, h, 2 * d, generator=gen).to(device)
    q_wide[:, :, :d] = q
    wide = torch.full((t, 30), -1, dtype=torch.int64, device=device)
    wide[:, 3:27] = sources[0][1]
    sources = [(sources[0][0], wide[:, 3:27]), sources[1]]
    out = sparse_attention(q_wide[:, :, :d], sources, sinks, 0.2,
                           SparseAttentionConfig(16, 16, 2, 4, 2))
    torch.testing.assert_close(out, reference.sparse_attention(q, sources, sinks, 0.2),
                               **KERNEL_TOL[torch.float32])


def test_triton_sparse_attention_rejects_bad_inputs(device):
    gen = torch.Generator().manual_seed(3)
    q, sources, sinks = make_inputs(2, 4, 16, [(4, 1, 5)], torch.float32, device, gen)
    with pytest.raises(ValueError, match="1 or 2"):
        sparse_attention(q, sources * 3, sinks, 1.0)
    with pytest.raises(ValueError, match="sinks must be"):
        sparse_attention(q, sources, sinks[:3], 1.0)
    with pytest.raises(ValueError, match="cache is torch.float32"):
        sparse_attention(q.half(), sources, sinks, 1.0)
    with pytest.raises(ValueError, match="slots must be"):
        sparse_attention(q, [(sources[0][0], sources[0][1][:1])], sinks, 1.0)


def test_backend_dispatches_to_the_kernel(monkeypatch, device):
    gen = torch.Generator().manual_seed(4)
    q, sources, sinks = make_inputs(3, 4, 32, [(8, 1, 12), (4, 1, 9)], torch.float32, device, gen)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    out = backend.sparse_attention(q, sources, sinks, 0.2)
    torch.testing.assert_close(out, reference.sparse_attention(q, sources, sinks, 0.2),
                               **KERNEL_TOL[torch.float32])


def test_rope_attention_matches_reference(monkeypatch, device):
    """backend.rope_attention (q norm + rope, attention, inverse rope) on the Triton kernels
    against the reference composition; the reference against its three parts."""
    gen = torch.Generator().manual_seed(6)
    t, h, d = 5, 4, 32
    q, sources, sinks = make_inputs(t, h, d, [(8, 1, 12), (4, 1, 9)], torch.float32, device, gen)
    positions = torch.tensor([0, 3, 17, 1000, 123456]).to(device)
    inv_freq = (1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))).to(device)
    args = (q, positions, inv_freq, 1.1, 1e-6, sources, sinks, 0.2)
    ref = reference.rope_attention(*args)
    parts = reference.interleaved_rope(
        reference.sparse_attention(reference.q_norm_rope(q, positions, inv_freq, 1.1, 1e-6), sources, sinks, 0.2),
        positions, inv_freq, 1.1, inverse=True)
    torch.testing.assert_close(ref, parts)
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    torch.testing.assert_close(backend.rope_attention(*args), ref, **KERNEL_TOL[torch.float32])


# --- real shapes (DeepSeek-V4-Flash: H 64, D 512, window 128, top-k 512) on the GPU -------------

def v4_slot_rows(positions: torch.Tensor, window: int, ratio: int, topk: int, bs: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(window slots [T, window], entry slots [T, topk], blocks needed) for queries at ``positions``
    of one sequence: the last ``window`` positions and ``topk`` random visible compressed entries
    (entry w is visible at position p when w < (p + 1) // ratio), each through a shuffled block table."""
    t = positions.shape[0]
    max_pos = int(positions.max()) + 1
    n_blocks = -(-max_pos // bs) + -(-(max_pos // ratio) // bs) + 1
    table = torch.randperm(n_blocks, generator=gen)
    pos = positions[:, None] - torch.arange(window - 1, -1, -1)[None, :]          # [T, window]
    win = torch.where(pos >= 0, table[pos.clamp(min=0) // bs] * bs + pos.clamp(min=0) % bs, -1)
    entries = (positions + 1) // ratio                                           # [T] visible count
    width = max(1, int(entries.max()))
    score = torch.rand(t, width, generator=gen).masked_fill(torch.arange(width)[None] >= entries[:, None], -1)
    picked = score.topk(min(topk, width), dim=1).indices                         # [T, k]
    first_entry_block = -(-max_pos // bs)
    ent = table[first_entry_block + picked // bs] * bs + picked % bs
    ent = torch.where(picked < entries[:, None], ent, -1)
    if ent.shape[1] < topk:
        ent = torch.cat([ent, torch.full((t, topk - ent.shape[1]), -1)], dim=1)
    return win, ent, n_blocks


def v4_inputs(t: int, decode: bool, dtype: torch.dtype, gen: torch.Generator,
              h: int = 64, d: int = 512, bs: int = 16, context: int = 8192):
    """Decode: t sequences of ``context`` tokens, one query each; prefill: t queries at 0..t-1."""
    if decode:
        rows = [v4_slot_rows(torch.tensor([context - 1]), 128, 4, 512, bs, gen) for _ in range(t)]
        offsets = torch.tensor([0] + [r[2] for r in rows]).cumsum(0)
        win = torch.cat([torch.where(r[0] >= 0, r[0] + o * bs, -1) for r, o in zip(rows, offsets)])
        ent = torch.cat([torch.where(r[1] >= 0, r[1] + o * bs, -1) for r, o in zip(rows, offsets)])
        n_blocks = int(offsets[-1])
    else:
        win, ent, n_blocks = v4_slot_rows(torch.arange(t), 128, 4, 512, bs, gen)
    window_cache, entry_cache = page_buffer_caches(n_blocks, [(bs, 1, d), (bs, 1, d)], dtype,
                                                   torch.device("cuda"), gen)
    q = torch.randn(t, h, d, generator=gen).to("cuda", dtype)
    sinks = torch.randn(h, generator=gen).to("cuda")
    sources = [(window_cache, win.int().cuda()), (entry_cache, ent.int().cuda())]
    return q, sources, sinks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,decode,dtype", [(1, True, torch.bfloat16), (16, True, torch.bfloat16),
                                            (64, True, torch.bfloat16), (256, True, torch.bfloat16),
                                            (64, True, torch.float32), (4096, False, torch.bfloat16)])
def test_triton_sparse_attention_gpu_sizes(t, decode, dtype, poison_empty):
    gen = torch.Generator().manual_seed(t)
    q, sources, sinks = v4_inputs(t, decode, dtype, gen)
    out = sparse_attention(q, sources, sinks, 512 ** -0.5)
    ref = reference.sparse_attention(q, sources, sinks, 512 ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])
    # One window source only (SWA layers).
    out = sparse_attention(q, sources[:1], sinks, 512 ** -0.5)
    torch.testing.assert_close(out, reference.sparse_attention(q, sources[:1], sinks, 512 ** -0.5),
                               **KERNEL_TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block_h,block_n,num_warps", [(16, 32, 4), (32, 32, 4), (32, 64, 8),
                                                       (64, 32, 8), (64, 64, 8)])
@pytest.mark.parametrize("t,decode,splits", [(16, True, 4), (512, False, 1)])
def test_triton_sparse_attention_gpu_configs(block_h, block_n, num_warps, t, decode, splits,
                                             poison_empty):
    """Every tile config gpu_kernel_check.py times compiles and is exact."""
    gen = torch.Generator().manual_seed(5)
    q, sources, sinks = v4_inputs(t, decode, torch.bfloat16, gen)
    config = SparseAttentionConfig(block_h, block_n, splits, num_warps, num_stages=2)
    out = sparse_attention(q, sources, sinks, 512 ** -0.5, config)
    ref = reference.sparse_attention(q, sources, sinks, 512 ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[torch.bfloat16])


# -- packed record sources (DeepSeek-V4.1's KV records) ---------------------------------------------
def packed_inputs(t, h, d, specs, dtype, device, gen, num_blocks=12):
    """q [t, h, d], sinks [h], and the sources of ``specs`` = [(bs, nt, K, fmt or None)] three times:
    as the kernel reads them (record caches for a format, value caches of ``dtype`` for None), and
    as value caches of the same numbers (the records decoded) in float32 and in ``dtype``. Row 1
    sees no key."""
    sources, values, q_values, formats = [], [], [], []
    for bs, nt, k, fmt in specs:
        if fmt is None:
            (cache,) = page_buffer_caches(num_blocks, [(bs, nt, d)], dtype, device, gen)
            plain = cache.float()
        else:
            (cache,), (plain,) = page_buffer_records(num_blocks, [(bs, nt, d, fmt)], torch.float32, device, gen)
        slots = random_slots(t, k, num_blocks * bs, gen, 0.25, (1,)).to(device)
        sources.append((cache, slots))
        values.append((plain, slots))
        q_values.append((plain.to(dtype), slots))
        formats.append(fmt)
    q = (torch.randn(t, h, d, generator=gen) * 2).to(dtype).to(device)
    sinks = torch.randn(h, generator=gen).to(device)
    return q, sinks, sources, values, q_values, formats


PACKED_CASES = [
    # t, h, d, sources [(bs, nt, K, fmt)], dtype, config
    (4, 4, 64, [(8, 1, 40, "mxfp8"), (4, 1, 17, "nvfp4")], torch.float32, None),     # window + entries
    (5, 4, 64, [(8, 1, 24, "mxfp8"), (4, 2, 17, "nvfp4")], torch.float32,
     SparseAttentionConfig(16, 16, 3, 4, 2)),                                         # splits
    (3, 6, 32, [(4, 1, 20, "nvfp4")], torch.float16, None),                           # one source
    (4, 16, 96, [(8, 1, 21, None), (4, 1, 33, "mxfp8")], torch.float16,
     SparseAttentionConfig(16, 16, 1, 4, 2)),                  # D not a power of two; a plain source beside
    (3, 4, 64, [(8, 1, 9, "mxfp4"), (8, 2, 30, "mxfp8")], torch.float32, None),
]


@pytest.mark.parametrize("t,h,d,specs,dtype,config", PACKED_CASES)
def test_triton_sparse_attention_reads_packed_records(t, h, d, specs, dtype, config, device, poison_empty):
    """Record sources decoded in the kernel: the kernel's result on the records' values, bit for
    bit (the decode is exact in q's dtype here), and so the reference's; the reference on the
    records equals it on those values exactly."""
    gen = torch.Generator().manual_seed(sum(k for _, _, k, _ in specs) + d)
    q, sinks, sources, values, q_values, formats = packed_inputs(t, h, d, specs, dtype, device, gen)
    ref = reference.sparse_attention(q, values, sinks, 0.2)
    assert torch.equal(reference.sparse_attention(q, sources, sinks, 0.2, formats), ref)
    out = sparse_attention(q, sources, sinks, 0.2, config, formats=formats)
    assert not out.isnan().any()
    on_values = sparse_attention(q, q_values, sinks, 0.2, config)
    if out.is_cuda:
        # On the GPU the decoded tile may reach the tensor cores by another path (registers
        # rather than shared memory) and sum in another order: equal to rounding, not bitwise.
        torch.testing.assert_close(out, on_values, atol=2e-3, rtol=2e-3)
    else:
        assert torch.equal(out, on_values)
    torch.testing.assert_close(out, ref, **KERNEL_TOL[dtype])
    assert torch.equal(out[1], torch.zeros_like(out[1]))       # row 1 has no key in any source


def test_backend_passes_record_formats(monkeypatch, device):
    gen = torch.Generator().manual_seed(12)
    q, sinks, sources, values, _, formats = packed_inputs(3, 4, 32, [(8, 1, 12, "mxfp8"), (4, 1, 9, "nvfp4")],
                                                          torch.float32, device, gen)
    ref = reference.sparse_attention(q, values, sinks, 0.2)
    for choice in ("triton", "torch"):
        monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", choice)
        torch.testing.assert_close(backend.sparse_attention(q, sources, sinks, 0.2, formats), ref,
                                   **KERNEL_TOL[torch.float32])


def test_triton_sparse_attention_rejects_bad_record_sources(device):
    gen = torch.Generator().manual_seed(13)
    q, sinks, sources, _, _, formats = packed_inputs(2, 4, 32, [(4, 1, 5, "mxfp8")], torch.float32, device, gen)
    with pytest.raises(ValueError, match=r"nvfp4 record of D=32: 18 bytes\], got \(12, 4, 1, 1, 33\)"):
        sparse_attention(q, sources, sinks, 1.0, formats=["nvfp4"])
    with pytest.raises(ValueError, match=r"D=32\], got \(12, 4, 1, 1, 33\)"):
        sparse_attention(q, sources, sinks, 1.0)            # records read as values
    with pytest.raises(ValueError, match="formats has 2 entries for 1 sources"):
        sparse_attention(q, sources, sinks, 1.0, formats=formats * 2)
    with pytest.raises(ValueError, match="'fp8' is not one of"):
        sparse_attention(q, sources, sinks, 1.0, formats=["fp8"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t,decode", [(1, True), (16, True), (64, True), (4096, False)])
def test_triton_sparse_attention_gpu_packed_records(t, decode, poison_empty):
    """DeepSeek-V4.1 sizes: 64 bf16 heads x 512 over MXFP8 window rows and NVFP4 entries; long
    prefill chunks stay on the Triton kernel (the Gluon kernel reads no records)."""
    from deepinfer.kernels import sparse_attention as sa
    gen = torch.Generator().manual_seed(t)
    q, plain_sources, sinks = v4_inputs(t, decode, torch.bfloat16, gen)
    n_blocks = plain_sources[0][0].shape[0]
    caches, values = page_buffer_records(n_blocks, [(16, 1, 512, "mxfp8"), (16, 1, 512, "nvfp4")],
                                         torch.float32, torch.device("cuda"), gen)
    formats = ["mxfp8", "nvfp4"]
    sources = [(cache, slots) for cache, (_, slots) in zip(caches, plain_sources)]
    assert not sa._takes_gluon(q, sources, formats)
    out = sparse_attention(q, sources, sinks, 512 ** -0.5, formats=formats)
    ref = reference.sparse_attention(q, [(v, slots) for v, (_, slots) in zip(values, plain_sources)], sinks,
                                     512 ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, **KERNEL_TOL[torch.bfloat16])
