"""DeepSeek-V4.1 ratio-r pooling (deepinfer/kernels/pool_window.py) against
:func:`reference.pool_window` on random paged states, and the reference against a direct
per-row softmax."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.pool_window import pool_window
from tests.kernels.paged_sources import page_buffer_caches


def make_case(ratio: int, d: int, bs: int, dtype: torch.dtype, gen: torch.Generator, lens: list[int],
              rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(state cache [NB, bs, 2, 1, d] as a strided view into a page buffer, its block table
    [B, nb] (distinct random blocks, the null block 0 past each sequence's end), seq [rows] int32,
    pos [rows] int64): random rows of random sequences, positions 0 .. len-1 (those below
    ratio - 1 have slots before position 0)."""
    cols = max(-(-n // bs) for n in lens) + 1
    num_blocks = sum(-(-n // bs) for n in lens) + 1
    (state,) = page_buffer_caches(num_blocks, [(bs, 2, d)], dtype, torch.device("cpu"), gen)
    state[:, :, 1] = (torch.randn(num_blocks, bs, 1, d, generator=gen) * 3).to(dtype)   # raw gates
    state[0] = float("nan")                                                            # the null block
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    table = torch.zeros(len(lens), cols, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        k = -(-n // bs)
        table[b, :k] = perm[used:used + k]
        used += k
    seq = torch.randint(0, len(lens), (rows,), generator=gen, dtype=torch.int32)
    pos = (torch.rand(rows, generator=gen) * torch.tensor(lens, dtype=torch.float32)[seq.long()]).long()
    pos[0] = 0                                     # a window with ratio - 1 slots before position 0
    return state, table, seq, pos


@pytest.mark.parametrize("ratio, d, bs, lens, rows", [
    (2, 64, 4, [9, 5, 16], 7),       # the release's ratio; odd row count, odd lengths
    (2, 512, 8, [20, 3], 5),         # the release's width
    (1, 48, 2, [7, 4], 3),           # ratio 1: each token alone
    (3, 40, 2, [11, 6, 2], 9),       # a window straddling blocks; width not a power of two
    (4, 96, 4, [13], 6),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_window_matches_reference(device, ratio, d, bs, lens, rows, dtype):
    gen = torch.Generator().manual_seed(ratio * 100 + d + rows)
    state, table, seq, pos = make_case(ratio, d, bs, dtype, gen, lens, rows)
    got = pool_window(state.to(device), table.to(device), seq.to(device), pos.to(device), ratio)
    want = reference.pool_window(state, table, seq, pos, ratio)
    assert got.dtype == torch.float32 and got.shape == (rows, d)
    assert not want.isnan().any()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)


def test_pool_window_int64_table_and_no_rows(device):
    gen = torch.Generator().manual_seed(1)
    state, table, seq, pos = make_case(2, 32, 4, torch.float32, gen, [8, 6], 5)
    got = pool_window(state.to(device), table.long().to(device), seq.long().to(device), pos.to(device), 2)
    torch.testing.assert_close(got.cpu(), reference.pool_window(state, table, seq, pos, 2), rtol=1e-6, atol=1e-6)
    empty = pool_window(state.to(device), table.to(device), seq[:0].to(device), pos[:0].to(device), 2)
    assert empty.shape == (0, 32)


def test_reference_is_a_per_row_softmax_pool():
    gen = torch.Generator().manual_seed(2)
    ratio, bs = 3, 2
    state, table, seq, pos = make_case(ratio, 16, bs, torch.float32, gen, [9, 7], 6)
    got = reference.pool_window(state, table, seq, pos, ratio)
    for m in range(seq.shape[0]):
        b, p = int(seq[m]), int(pos[m])
        kvs, gates = [], []
        for q in range(max(0, p - ratio + 1), p + 1):
            block, off = int(table[b, q // bs]), q % bs
            kvs.append(state[block, off, 0, 0])
            gates.append(state[block, off, 1, 0])
        kv, gate = torch.stack(kvs), torch.stack(gates)                          # [S, D]
        weights = torch.exp(gate - gate.max(0).values) / torch.exp(gate - gate.max(0).values).sum(0)
        torch.testing.assert_close(got[m], (weights * kv).sum(0), rtol=1e-6, atol=1e-6)
    assert math.isfinite(float(got.sum()))


def test_launcher_checks_shapes():
    gen = torch.Generator().manual_seed(3)
    state, table, seq, pos = make_case(2, 16, 4, torch.float32, gen, [8], 3)
    with pytest.raises(ValueError, match="state_cache must be"):
        pool_window(state[:, :, :1], table, seq, pos, 2)
    with pytest.raises(ValueError, match="pos must be"):
        pool_window(state, table, seq, pos[:2], 2)
    with pytest.raises(ValueError, match="ratio must be"):
        pool_window(state, table, seq, pos, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_sizes_in_a_cuda_graph():
    """Ratio 2, 512 channels, bf16 states in 64-token pages; captured once and replayed with
    new positions."""
    from tests.kernels.conftest import capture
    gen = torch.Generator().manual_seed(9)
    state, table, seq, pos = make_case(2, 512, 64, torch.bfloat16, gen, [300, 129, 64], 33)
    state, table, seq, pos = state.cuda(), table.cuda(), seq.cuda(), pos.cuda()
    graph, out = capture(lambda: pool_window(state, table, seq, pos, 2))
    for _ in range(2):
        new = torch.randint(0, 64, (33,), generator=gen)
        pos.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want = reference.pool_window(state.cpu(), table.cpu(), seq.cpu(), new, 2)
        torch.testing.assert_close(out.cpu(), want, rtol=1e-6, atol=1e-6)
