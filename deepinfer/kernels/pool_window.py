"""DeepSeek-V4.1 ratio-r compressor pooling from the paged state cache; reference:
:func:`reference.pool_window`.

Row m (position p of sequence row ``seq[m]``) pools the states of positions ``p-r+1 .. p``:

    out[m, d] = sum_s softmax_s(gate[s, d]) * kv[s, d]

per channel, in float32; slots before position 0 weigh 0 (their kv and gate are never
read). The softmax is written as the reference computes it (``exp(g - max)`` normalised by
its sum, then the weighted sum), so the two differ only by the exponential's last-bit
rounding. Unlike V4's compressor (``compressor.py``) it stores nothing and has no position
bias, overlap, norm or rope: the layer norms and ropes the pooled latent itself.

Grid (M, ceil(D / BLOCK_D)): a program loads its row's r slots x BLOCK_D channels of kv and
gate at once (r = 2 in the release). The state cache is a strided view into a page buffer
shared by many layers: every stride is passed, never assumed. Every row is pooled, whether it
completes a window or not (a decode step pools every token and stores the incomplete ones
at slot -1), so nothing depends on data: no host synchronisation (CUDA-graph safe).

Shapes: M rows, r ratio, D channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

# Slots x channels of one program's tile: at r = 2 a 512-channel row in one program, so the
# kv and gate tiles hold 8 float32 registers a thread with 4 warps.
_TILE_ELEMS = 1024


@triton.jit
def _pool_window_kernel(
    state_ptr, table_ptr, seq_ptr, pos_ptr, out_ptr,
    stride_state_block, stride_state_offset, stride_state_tensor,
    stride_table_row, stride_table_col, stride_out_row,
    RATIO: tl.constexpr, HEAD_DIM: tl.constexpr, STATE_BS: tl.constexpr, TABLE_COLS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)                       # [BLOCK_D]
    d_ok = d < HEAD_DIM
    seq = tl.load(seq_ptr + row).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    q = pos - RATIO + 1 + s                                                      # [BLOCK_S] positions
    valid = (s < RATIO) & (q >= 0)
    # As reference.table_slots: the block column clamped to the table's width.
    col = tl.minimum(tl.maximum(q, 0) // STATE_BS, TABLE_COLS - 1)
    block = tl.load(table_ptr + seq * stride_table_row + col * stride_table_col, mask=valid, other=0).to(tl.int64)
    base = block * stride_state_block + (tl.maximum(q, 0) % STATE_BS) * stride_state_offset   # [BLOCK_S]
    mask = valid[:, None] & d_ok[None, :]
    src = state_ptr + base[:, None] + d[None, :]
    kv = tl.load(src, mask=mask, other=0.0).to(tl.float32)                       # [BLOCK_S, BLOCK_D]
    gate = tl.load(src + stride_state_tensor, mask=mask, other=float("-inf")).to(tl.float32)
    top = tl.max(gate, axis=0)                                                   # [BLOCK_D]
    # Channels past D (and rows with no valid slot) have no finite gate: 0 keeps -inf - -inf
    # out of the exponent; such a row still pools to 0/0 = NaN, as the reference's does.
    top = tl.where(top == float("-inf"), 0.0, top)
    e = tl.exp(gate - top[None, :])
    weights = e / tl.where(d_ok, tl.sum(e, axis=0), 1.0)[None, :]
    out = tl.sum(kv * weights, axis=0)
    tl.store(out_ptr + row * stride_out_row + d, out, mask=d_ok)


def pool_window(state_cache: torch.Tensor, state_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                ratio: int) -> torch.Tensor:
    """[M, D] float32 softmax-gated pool of each row's window (see the module docstring).

    state_cache: [NB, bs, 2, 1, D] (tensor 0 kv, tensor 1 raw gate; any strides, last dim
    contiguous); state_table: [B, nb] int32/int64; seq, pos: [M] int (sequence row and
    position of each row, positions >= 0).
    """
    if state_cache.dim() != 5 or state_cache.shape[2] != 2 or state_cache.shape[3] != 1:
        raise ValueError(f"pool_window: state_cache must be [num_blocks, block_size, 2, 1, D], "
                         f"got shape {tuple(state_cache.shape)}")
    if state_cache.stride(-1) != 1:
        raise ValueError("pool_window: the state cache's last dim must be contiguous")
    device = state_cache.device
    if (state_table.dim() != 2 or state_table.dtype not in (torch.int32, torch.int64)
            or state_table.device != device or state_table.shape[1] == 0):
        raise ValueError(f"pool_window: state_table must be a 2-D int32/int64 block table on {device}, "
                         f"got {state_table.dtype} of shape {tuple(state_table.shape)} on {state_table.device}")
    m = seq.shape[0]
    for name, t in (("seq", seq), ("pos", pos)):
        if t.shape != (m,) or t.dtype not in (torch.int32, torch.int64) or t.device != device:
            raise ValueError(f"pool_window: {name} must be a [{m}] int32/int64 tensor on {device}, "
                             f"got {t.dtype} of shape {tuple(t.shape)} on {t.device}")
    if ratio < 1:
        raise ValueError(f"pool_window: ratio must be >= 1, got {ratio}")
    d = state_cache.shape[-1]
    out = torch.empty(m, d, dtype=torch.float32, device=device)
    if m == 0:
        return out
    # Tile config: all r slots (padded to a power of two) x as many channels as fill
    # _TILE_ELEMS; 4 warps.
    block_s = triton.next_power_of_2(ratio)
    block_d = min(triton.next_power_of_2(d), max(16, _TILE_ELEMS // block_s))
    _pool_window_kernel[(m, triton.cdiv(d, block_d))](
        state_cache, state_table, seq.contiguous(), pos.contiguous(), out,
        state_cache.stride(0), state_cache.stride(1), state_cache.stride(2),
        state_table.stride(0), state_table.stride(1), out.stride(0),
        RATIO=ratio, HEAD_DIM=d, STATE_BS=state_cache.shape[1], TABLE_COLS=state_table.shape[1],
        BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4, **pdl.flags(device))
    return out
