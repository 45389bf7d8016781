"""Per-token slot tables of a paged cache, one launch; reference: :func:`reference.paged_slots`.

DeepSeek-V4 attention reads its keys by flat slot (``block * bs + offset``): the
window's last W tokens of each query's sequence, and the compressed entries the
query may see. Built from torch ops that is a dozen small launches per table per
layer (arange, div, clamp, a gather from the block table, where, ...), which at
decode costs more device time than the table is worth. Here one program per
(token, column tile) computes the index of each column, checks it is visible,
reads the block id and writes the slot or -1.

Shapes: T tokens, B sequences, nb blocks per table row, Wd table width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl


@triton.jit
def _paged_slots_kernel(
    table_ptr, seq_ptr, pos_ptr, out_ptr,
    table_stride, num_cols, width, ratio,
    BLOCK_SIZE: tl.constexpr, SLIDING: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)          # [BW]
    p = tl.load(pos_ptr + t).to(tl.int64)
    s = tl.load(seq_ptr + t).to(tl.int64)
    if SLIDING:
        index = p + 1 - width + cols                                   # tokens p-W+1 .. p
        valid = (index >= 0) & (cols < width)
    else:
        index = cols.to(tl.int64)                                      # entries 0 .. Wd-1
        valid = (index < (p + 1) // ratio) & (cols < width)
    col = tl.minimum(index // BLOCK_SIZE, num_cols - 1)
    block = tl.load(table_ptr + s * table_stride + col, mask=valid, other=0).to(tl.int64)
    slot = tl.where(valid, block * BLOCK_SIZE + index % BLOCK_SIZE, -1)
    tl.store(out_ptr + t * width + cols, slot, mask=cols < width)


def paged_slots(block_table: torch.Tensor, block_size: int, seq: torch.Tensor, positions: torch.Tensor,
                width: int, ratio: int, sliding: bool) -> torch.Tensor:
    """block_table [B, nb] int; seq, positions [T] int -> [T, width] int64 slots
    (see :func:`reference.paged_slots`)."""
    t = positions.shape[0]
    out = torch.empty(t, width, dtype=torch.int64, device=positions.device)
    if t == 0 or width == 0:
        return out
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    # Tile config: up to 1024 columns per program (a decode table is 128-2048 wide), 4 warps.
    block_w = min(triton.next_power_of_2(width), 1024)
    _paged_slots_kernel[(t, triton.cdiv(width, block_w))](
        block_table, seq, positions, out, block_table.stride(0), block_table.shape[1], width, ratio,
        BLOCK_SIZE=block_size, SLIDING=sliding, BLOCK_W=block_w, num_warps=4, **pdl.flags(block_table.device))
    return out
