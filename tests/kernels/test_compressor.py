"""DeepSeek-V4 compressor pooling: the Triton kernel (deepinfer/kernels/compressor.py) against
:func:`reference.compress_entries_` on random paged states, and the reference against a
direct per-row computation."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.compressor import compress_entries_
from tests.kernels.paged_sources import page_buffer_caches

# The reference rounds the softmax weights, the weighted terms and their sum to the cache
# dtype (as the layer always did); the kernel pools in float32, so half-precision entries
# agree to a few ulps of their O(1) normalised values.
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.float16: {"rtol": 1e-2, "atol": 1e-2},
       torch.bfloat16: {"rtol": 4e-2, "atol": 4e-2}}


def _table(lens: list[int], bs: int, pool: torch.Tensor, skip: list[int]) -> torch.Tensor:
    """[B, cols] int32 block table: distinct blocks out of ``pool`` for the columns ``skip[b] ..
    ceil(lens[b] / bs) - 1`` of each sequence, 0 (the null block) elsewhere."""
    cols = max(-(-n // bs) for n in lens) + 1
    table = torch.zeros(len(lens), cols, dtype=torch.int32)
    used = 0
    for b, (n, k0) in enumerate(zip(lens, skip)):
        k = -(-n // bs) - k0
        table[b, k0:k0 + k] = pool[used:used + k]
        used += k
    return table


def make_case(ratio: int, overlap: bool, d: int, rope_dims: int, dtype: torch.dtype, device: torch.device,
              gen: torch.Generator, lens: list[int], first: list[int], state_bs: int = 4, entry_bs: int = 2,
              evict_before: int = 0, pos_offset: int = 0):
    """Paged caches (views into one NaN-filled page buffer), block tables and rows.

    Sequence b holds ``lens[b] + pos_offset`` tokens; its rows are positions ``first[b] + pos_offset
    ..`` to its end, shuffled. The state blocks wholly before ``pos_offset - 2r`` (and, for
    sequence 0, before ``evict_before``) are the null block, as a sliding window's returned blocks
    are, and so are the entry blocks before ``pos_offset``; ``pos_offset`` must be a multiple of r
    and of both block sizes.
    """
    c = (2 if overlap else 1) * d
    lens = [n + pos_offset for n in lens]
    # An overlapping first row past pos_offset still reads the window before it.
    held_from = max(0, pos_offset - 2 * ratio)
    state_skip = [(max(evict_before, held_from) if b == 0 else held_from) // state_bs for b in range(len(lens))]
    entry_lens = [n // ratio for n in lens]
    entry_skip = [pos_offset // ratio // entry_bs] * len(lens)
    n_state = sum(-(-n // state_bs) - k for n, k in zip(lens, state_skip))
    n_entry = sum(-(-n // entry_bs) - k for n, k in zip(entry_lens, entry_skip))
    num_blocks = n_state + n_entry + 3
    state, entries = page_buffer_caches(num_blocks, [(state_bs, 2, c), (entry_bs, 1, d)], dtype, device, gen)
    state[:, :, 1] = torch.randn(num_blocks, state_bs, 1, c, generator=gen).to(dtype).to(device)
    state[0] = float("nan")                                       # the null block
    entries[0] = float("nan")
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    state_table = _table(lens, state_bs, perm[:n_state], state_skip)
    entry_table = _table(entry_lens, entry_bs, perm[n_state:], entry_skip)
    seq = torch.cat([torch.full((n - f - pos_offset,), b, dtype=torch.int32)
                     for b, (n, f) in enumerate(zip(lens, first))])
    pos = torch.cat([torch.arange(f + pos_offset, n) for n, f in zip(lens, first)])
    order = torch.randperm(seq.shape[0], generator=gen)
    bias = torch.randn(ratio, c, generator=gen)
    norm_w = torch.rand(d, generator=gen) + 0.5
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dims, 2, dtype=torch.float32) / rope_dims))
    return (state, state_table.to(device), entries, entry_table.to(device), seq[order].to(device),
            pos[order].to(device), bias.to(device), norm_w.to(device), 1e-6, inv_freq.to(device), 1.25,
            ratio, overlap)


def changed_entries(out: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """[NB, bs] which entries differ (NaN equal to NaN)."""
    same = (out == before) | (out.isnan() & before.isnan())
    return ~same.all(-1).flatten(2).all(-1)


def run_both(args):
    """(entry cache after the kernel, after the reference), both from the same start."""
    state, state_table, entries, *rest = args
    expected = entries.clone()
    reference.compress_entries_(state.clone(), state_table, expected, *rest)
    compress_entries_(state, state_table, entries, *rest)
    return entries, expected


def test_reference_matches_direct_pool():
    """One row at a time, straight from the definition (overlap, first window included)."""
    gen = torch.Generator().manual_seed(0)
    r, d = 4, 8
    args = make_case(r, True, d, 4, torch.float32, torch.device("cpu"), gen, [13], [0], state_bs=4, entry_bs=2)
    state, state_table, entries, entry_table, _, _, bias, norm_w, eps, inv_freq, scaling, _, _ = args
    before = entries.clone()
    reference.compress_entries_(*args)

    def states(q: int) -> torch.Tensor:
        return state[state_table[0, q // 4], q % 4, :, 0]         # [2, 2D] kv, gate of position q

    for p in range(13):
        if (p + 1) % r:
            continue
        w = (p + 1) // r - 1
        terms = [(states(q)[0, d:], states(q)[1, d:] + bias[q - p + r - 1, d:]) for q in range(p - r + 1, p + 1)]
        if w > 0:
            terms += [(states(q)[0, :d], states(q)[1, :d] + bias[q - p + 2 * r - 1, :d])
                      for q in range(p - 2 * r + 1, p - r + 1)]
        kv = torch.stack([t[0] for t in terms])
        weights = torch.stack([t[1] for t in terms]).softmax(0)
        x = (weights * kv).sum(0)
        x = norm_w * x / torch.sqrt(x.pow(2).mean() + eps)
        angle = (p + 1 - r) * inv_freq
        cos, sin = angle.cos() * scaling, angle.sin() * scaling
        e, o = x[d - 4::2].clone(), x[d - 3::2].clone()
        x[d - 4::2], x[d - 3::2] = e * cos - o * sin, o * cos + e * sin
        got = entries[entry_table[0, w // 2], w % 2, 0, 0]
        torch.testing.assert_close(got, x, rtol=1e-5, atol=1e-5)
    written = torch.zeros_like(before, dtype=torch.bool)
    for w in range(3):
        written[entry_table[0, w // 2], w % 2] = True
    assert torch.equal(entries[~written].isnan(), before[~written].isnan())
    assert torch.equal(entries[~written].nan_to_num(), before[~written].nan_to_num())


CASES = [
    # ratio, overlap, D, R, dtype, lens, first rows, state bs, entry bs, evict before
    (4, True, 16, 8, torch.float32, [13, 9, 4], [0, 2, 3], 4, 2, 0),
    (4, True, 32, 32, torch.float16, [21, 6], [9, 0], 2, 4, 4),
    (8, False, 16, 16, torch.float32, [17, 24], [9, 0], 4, 1, 8),
    (8, False, 32, 8, torch.float16, [16, 9], [0, 6], 8, 2, 0),
]


@pytest.mark.parametrize("ratio,overlap,d,rope_dims,dtype,lens,first,state_bs,entry_bs,evict", CASES)
def test_triton_compressor_matches_reference(ratio, overlap, d, rope_dims, dtype, lens, first, state_bs,
                                             entry_bs, evict, device):
    gen = torch.Generator().manual_seed(ratio * d + len(lens))
    args = make_case(ratio, overlap, d, rope_dims, dtype, device, gen, lens, first, state_bs, entry_bs,
                     evict_before=evict)
    before = args[2].clone()
    out, expected = run_both(args)
    # Every completed window wrote a finite entry; nothing else changed (NaN stays NaN).
    n_entries = sum(n // ratio - f // ratio for n, f in zip(lens, first))
    assert n_entries > 0 and int(changed_entries(out, before).sum()) == n_entries
    torch.testing.assert_close(out, expected, equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize("overlap", [True, False])
def test_triton_compressor_long_context_rope(overlap, device):
    """Positions near 1e6: RoPE angles of ~1e6 rad keep their phase (float32 tolerance)."""
    gen = torch.Generator().manual_seed(6)
    args = make_case(4, overlap, 16, 16, torch.float32, device, gen, [12, 8], [0, 2], state_bs=4, entry_bs=2,
                     pos_offset=999_996)
    before = args[2].clone()
    out, expected = run_both(args)
    changed = changed_entries(out, before)
    assert int(changed.sum()) == 3 + 2                            # windows ending at 1e6+{3,7,11}, 1e6+{3,7}
    assert out[changed].isfinite().all()
    torch.testing.assert_close(out, expected, equal_nan=True, **TOL[torch.float32])


def test_triton_compressor_no_completing_row(device):
    """A decode-like batch where no row completes a window writes nothing."""
    gen = torch.Generator().manual_seed(3)
    args = list(make_case(4, True, 16, 8, torch.float32, device, gen, [6, 7], [4, 5]))
    before = args[2].clone()
    compress_entries_(*args)
    assert torch.equal(args[2].nan_to_num(), before.nan_to_num())
    assert torch.equal(args[2].isnan(), before.isnan())


def test_triton_compressor_rejects_bad_shapes(device):
    gen = torch.Generator().manual_seed(4)
    args = list(make_case(4, True, 16, 8, torch.float32, device, gen, [8], [0]))
    with pytest.raises(ValueError, match="state width"):
        compress_entries_(*args[:-1], False)
    args[6] = args[6][:, :16]
    with pytest.raises(ValueError, match="position_bias"):
        compress_entries_(*args)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ratio,overlap,d,rope_dims,state_bs", [(128, False, 512, 64, 128), (4, True, 512, 64, 64),
                                                                (4, True, 128, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_compressor_gpu_sizes(ratio, overlap, d, rope_dims, state_bs, dtype):
    """V4-Flash sizes (HCA r=128 D=512; CSA r=4 overlap D=512; indexer r=4 overlap D=128) at
    long-context positions, where RoPE angles reach ~1e5 rad."""
    gen = torch.Generator().manual_seed(ratio + d)
    lens = [3 * ratio + 1, 2 * ratio, 5 * ratio - 1, ratio]
    first = [0, ratio - 1, 2 * ratio, 0]
    args = make_case(ratio, overlap, d, rope_dims, dtype, torch.device("cuda"), gen, lens, first,
                     state_bs=state_bs, entry_bs=64)
    out, expected = run_both(args)
    torch.testing.assert_close(out, expected, equal_nan=True, **TOL[dtype])
    far = make_case(ratio, overlap, d, rope_dims, dtype, torch.device("cuda"), gen, [ratio * 3, ratio * 2],
                    [0, 0], state_bs=state_bs, entry_bs=64, pos_offset=math.lcm(ratio, state_bs, 64) * 800)
    out, expected = run_both(far)
    torch.testing.assert_close(out, expected, equal_nan=True, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_compressor_cuda_graph():
    """Captured once, replayed after the positions move: the kernel takes no host data."""
    gen = torch.Generator().manual_seed(5)
    args = list(make_case(4, True, 512, 64, torch.bfloat16, torch.device("cuda"), gen, [40, 33], [35, 28],
                          state_bs=64, entry_bs=64))
    seq, pos = args[4][:2].clone(), args[5][:2].clone()
    args[4], args[5] = seq, pos
    compress_entries_(*args)                                      # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compress_entries_(*args)
    expected = args[2].clone()
    pos.copy_(torch.tensor([31, 31], device="cuda"))
    seq.copy_(torch.tensor([0, 1], device="cuda", dtype=seq.dtype))
    graph.replay()
    reference.compress_entries_(args[0].clone(), args[1], expected, args[3], seq, pos, *args[6:])
    torch.testing.assert_close(args[2], expected, equal_nan=True, **TOL[torch.bfloat16])


def test_compressor_rows_out(device):
    """entry_table None: row m's entry goes to row m of a [M, 1, 1, 1, D] buffer (which the FP8 KV
    path then encodes), equal to what the paged store writes; rows that complete nothing are left."""
    gen = torch.Generator().manual_seed(11)
    state, state_table, entries, entry_table, seq, pos, *rest = make_case(
        4, True, 16, 8, torch.float32, device, gen, [13, 9], [0, 2], state_bs=4, entry_bs=2)
    m = seq.shape[0]
    rows = torch.full((m, 1, 1, 1, 16), 7.0, device=device)
    ref_rows = rows.clone()
    compress_entries_(state, state_table, rows, None, seq, pos, *rest)
    reference.compress_entries_(state, state_table, ref_rows, None, seq, pos, *rest)
    compress_entries_(state, state_table, entries, entry_table, seq, pos, *rest)
    done = (pos + 1) % 4 == 0
    w = ((pos + 1) // 4 - 1).clamp(min=0)
    paged = entries[entry_table[seq.long(), w // 2], w % 2, 0, 0]                  # [M, D]
    assert int(done.sum()) == 5                     # positions 3, 7, 11 and 3, 7
    assert torch.equal(rows[done, 0, 0, 0], paged[done])
    assert bool((rows[~done] == 7).all())
    torch.testing.assert_close(ref_rows, rows, **TOL[torch.float32])
    with pytest.raises(ValueError, match="one row per row"):
        compress_entries_(state, state_table, rows[:2], None, seq, pos, *rest)
