"""The Triton per-token slot tables against reference.paged_slots (and that against a
plain loop), on random block tables, positions and sequence rows."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.kernels.paged_slots import paged_slots


def loop_slots(table: torch.Tensor, bs: int, seq: list[int], pos: list[int], width: int, ratio: int,
               sliding: bool) -> torch.Tensor:
    rows = []
    for s, p in zip(seq, pos):
        row = []
        for i in range(width):
            index = p + 1 - width + i if sliding else i
            visible = index >= 0 if sliding else index < (p + 1) // ratio
            row.append(int(table[s, index // bs]) * bs + index % bs if visible else -1)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize("bs,width,ratio,sliding", [
    (16, 128, 1, True), (4, 7, 1, True), (16, 300, 4, False), (1, 33, 128, False), (64, 2048, 4, False)])
def test_paged_slots_matches_reference(bs, width, ratio, sliding, device):
    gen = torch.Generator().manual_seed(width + bs)
    b, t = 5, 13
    max_pos = max(width * ratio, 40) if not sliding else 3 * width
    nb = -(-(max_pos + 1) // bs) + 1
    table = torch.randint(1, 1000, (b, nb), generator=gen, dtype=torch.int32)
    seq = torch.randint(0, b, (t,), generator=gen, dtype=torch.int32)
    pos = torch.randint(0, max_pos, (t,), generator=gen)
    pos[:3] = torch.tensor([0, 1, ratio - 1 if ratio > 1 else 2])          # edges: nothing / one visible
    expected = loop_slots(table, bs, seq.tolist(), pos.tolist(), width, ratio, sliding)
    ref = reference.paged_slots(table, bs, seq, pos, width, ratio, sliding)
    assert torch.equal(ref, expected)
    out = paged_slots(table.to(device), bs, seq.to(device), pos.to(device), width, ratio, sliding)
    assert out.dtype == torch.int64 and torch.equal(out.cpu(), expected)


def test_paged_slots_strided_table_and_empty(device):
    gen = torch.Generator().manual_seed(3)
    wide = torch.randint(1, 50, (3, 20), generator=gen, dtype=torch.int32)
    table = wide[:, 2:12]                                                 # row stride 20
    seq = torch.tensor([2, 0, 1], dtype=torch.int32)
    pos = torch.tensor([37, 5, 12])
    expected = reference.paged_slots(table.contiguous(), 4, seq, pos, 9, 4, False)
    out = paged_slots(table.to(device), 4, seq.to(device), pos.to(device), 9, 4, False)
    assert torch.equal(out.cpu(), expected)
    none = paged_slots(table.to(device), 4, seq[:0].to(device), pos[:0].to(device), 9, 4, False)
    assert none.shape == (0, 9)
