"""DeepSeek-V4 compressor pooling: gather a window's (kv, gate) states by slot, pool them
into one entry and store it; reference: :func:`reference.compress_entries_`.

Row m (token position p of sequence row ``seq[m]``) completes a window when
``(p+1) % r == 0``; only then it writes entry ``w = (p+1)/r - 1``:

    entry = rope(RMSNorm(sum_s softmax_s(gate[s] + position_bias[s]) * kv[s]), p+1-r)

per channel, the softmax in float32 over the S window slots (positions ``p-S+1 .. p``).
Plain (S = r): the channels [0, D) of the window's r states. Overlapping (S = 2r, the
states 2D wide): the previous window's channels [0, D) then the own window's [D, 2D); the
first window has no predecessor, so its first r slots get weight 0. RoPE rotates the
adjacent channel pairs of the trailing R channels (cos/sin of ``(p+1-r) * inv_freq``, times
``rope_scaling``).

Grid (M,). A row that completes no window exits before any gather: in a decode step
every token is a row and most complete nothing. A completing row walks its slots in
tiles of BLOCK_S, each inside one half of the window (BLOCK_S divides r), with an online
softmax per channel; it keeps even and odd channels in separate vectors of D/2, so the
RoPE pairs sit at the same index of both. The caches are strided views into a page
buffer shared by many layers (runner/model_runner.py ``allocate_kv_cache``): every cache
stride is passed, never assumed. Nothing reads back to the host (CUDA-graph safe).

Shapes: M rows, r ratio, S slots per entry (r or 2r), C state width (D or 2D), D entry
width, R rope dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

# Slots x channels of one gathered tile (even and odd channels together): at D = 512 that is
# 8 slots, so the four tiles (kv, gate; even, odd) hold 32 float32 registers per thread with
# 8 warps; small windows (r = 4) load whole.
_TILE_ELEMS = 4096

# 2*pi = _TWO_PI_HI + _TWO_PI_LO to ~1e-14, both float32-exact; 1/(2*pi) only picks the turn.
_TWO_PI_HI: tl.constexpr = tl.constexpr(6.2831854820251465)
_TWO_PI_LO: tl.constexpr = tl.constexpr(-1.7484555314695172e-07)
_INV_TWO_PI: tl.constexpr = tl.constexpr(0.15915493667125702)


@triton.jit
def _compress_kernel(
    state_ptr, state_table_ptr, entry_ptr, entry_table_ptr, seq_ptr, pos_ptr,
    bias_ptr, norm_w_ptr, inv_freq_ptr,
    eps, rope_scaling,
    stride_state_block, stride_state_offset, stride_state_tensor,
    stride_state_table_row, stride_state_table_col,
    stride_entry_block, stride_entry_offset,
    stride_entry_table_row, stride_entry_table_col,
    stride_bias_row,
    RATIO: tl.constexpr, SPAN: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE_HALF: tl.constexpr,
    STATE_BS: tl.constexpr, ENTRY_BS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_HALF: tl.constexpr, OVERLAP: tl.constexpr, ROW_OUT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    # A negative position (never given by the runner) would otherwise complete entry -1.
    if ((pos + 1) % RATIO == 0) & (pos >= RATIO - 1):
        seq = tl.load(seq_ptr + row).to(tl.int64)
        pairs = tl.arange(0, BLOCK_HALF)                                         # [BLOCK_HALF]
        pair_ok = pairs < HEAD_DIM // 2
        even = 2 * pairs
        m_e = tl.full([BLOCK_HALF], float("-inf"), tl.float32)
        m_o = tl.full([BLOCK_HALF], float("-inf"), tl.float32)
        l_e = tl.zeros([BLOCK_HALF], tl.float32)
        l_o = tl.zeros([BLOCK_HALF], tl.float32)
        acc_e = tl.zeros([BLOCK_HALF], tl.float32)
        acc_o = tl.zeros([BLOCK_HALF], tl.float32)
        # The first window of an overlapping pool has no predecessor: start at its own half.
        start = tl.where(pos >= SPAN - 1, 0, SPAN - RATIO)
        for s0 in range(start, SPAN, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)                                       # [BLOCK_S] slot
            q = pos - SPAN + 1 + s                                               # its position (>= 0)
            block = tl.load(state_table_ptr + seq * stride_state_table_row
                            + (q // STATE_BS) * stride_state_table_col).to(tl.int64)
            base = block * stride_state_block + (q % STATE_BS) * stride_state_offset  # [BLOCK_S]
            if OVERLAP:
                half = s0 // RATIO            # 0: the previous window's channels, 1: its own
            else:
                half = 0
            ch = half * HEAD_DIM + even                                          # [BLOCK_HALF]
            mask = pair_ok[None, :]
            src = state_ptr + base[:, None] + ch[None, :]                        # [BLOCK_S, BLOCK_HALF]
            bias = bias_ptr + (s - half * RATIO)[:, None] * stride_bias_row + ch[None, :]
            kv_e = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            kv_o = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
            g_e = (tl.load(src + stride_state_tensor, mask=mask, other=0.0).to(tl.float32)
                   + tl.load(bias, mask=mask, other=0.0))
            g_o = (tl.load(src + stride_state_tensor + 1, mask=mask, other=0.0).to(tl.float32)
                   + tl.load(bias + 1, mask=mask, other=0.0))
            # Online softmax over slots, per channel; the first tile always holds real
            # slots, so the running max is finite from then on.
            new_e = tl.maximum(m_e, tl.max(g_e, axis=0))
            new_o = tl.maximum(m_o, tl.max(g_o, axis=0))
            p_e = tl.exp(g_e - new_e[None, :])
            p_o = tl.exp(g_o - new_o[None, :])
            alpha_e = tl.exp(m_e - new_e)
            alpha_o = tl.exp(m_o - new_o)
            l_e = l_e * alpha_e + tl.sum(p_e, axis=0)
            l_o = l_o * alpha_o + tl.sum(p_o, axis=0)
            acc_e = acc_e * alpha_e + tl.sum(p_e * kv_e, axis=0)
            acc_o = acc_o * alpha_o + tl.sum(p_o * kv_o, axis=0)
            m_e, m_o = new_e, new_o
        x_e = tl.where(pair_ok, acc_e / l_e, 0.0)
        x_o = tl.where(pair_ok, acc_o / l_o, 0.0)
        # RMSNorm with its float32 weight; the result rounds to the entry dtype before RoPE,
        # as the reference does.
        inv_rms = 1.0 / tl.sqrt((tl.sum(x_e * x_e, axis=0) + tl.sum(x_o * x_o, axis=0)) / HEAD_DIM + eps)
        out_ty = entry_ptr.dtype.element_ty
        y_e = (x_e * inv_rms * tl.load(norm_w_ptr + even, mask=pair_ok, other=0.0)).to(out_ty).to(tl.float32)
        y_o = (x_o * inv_rms * tl.load(norm_w_ptr + even + 1, mask=pair_ok, other=0.0)).to(out_ty).to(tl.float32)
        # RoPE on the trailing ROPE_HALF pairs, at the window's first position.
        freq_idx = pairs - (HEAD_DIM // 2 - ROPE_HALF)
        rot = pair_ok & (freq_idx >= 0)
        inv_freq = tl.load(inv_freq_ptr + freq_idx, mask=rot, other=0.0)
        angle = (pos + 1 - RATIO).to(tl.float32) * inv_freq                      # as torch: fp32 product
        # Reduce modulo 2*pi in float64 first: angles reach ~1e6 rad at long contexts, where a
        # fast float32 cos/sin would lose the phase. Float literals become float32 constants, so
        # 2*pi enters as two float32-exact parts (turns * _TWO_PI_HI is exact in float64).
        a64 = angle.to(tl.float64)
        turns = tl.floor(a64 * _INV_TWO_PI + 0.5)
        reduced = (a64 - turns * _TWO_PI_HI - turns * _TWO_PI_LO).to(tl.float32)
        cos = tl.where(rot, tl.cos(reduced) * rope_scaling, 1.0)
        sin = tl.where(rot, tl.sin(reduced) * rope_scaling, 0.0)
        out_e = y_e * cos - y_o * sin
        out_o = y_o * cos + y_e * sin
        if ROW_OUT:
            # Row m's entry at row m of a [M, D] buffer, which the caller encodes and stores.
            dst = entry_ptr + row * stride_entry_block + even
        else:
            w = (pos + 1) // RATIO - 1                                           # entry index
            eblock = tl.load(entry_table_ptr + seq * stride_entry_table_row
                             + (w // ENTRY_BS) * stride_entry_table_col).to(tl.int64)
            dst = entry_ptr + eblock * stride_entry_block + (w % ENTRY_BS) * stride_entry_offset + even
        tl.store(dst, out_e.to(out_ty), mask=pair_ok)
        tl.store(dst + 1, out_o.to(out_ty), mask=pair_ok)


def _check_table(name: str, table: torch.Tensor, device: torch.device) -> None:
    if table.dim() != 2 or table.dtype not in (torch.int32, torch.int64) or table.device != device:
        raise ValueError(f"compress_entries_: {name} must be a 2-D int32/int64 block table on {device}, "
                         f"got {table.dtype} of shape {tuple(table.shape)} on {table.device}")


def compress_entries_(state_cache: torch.Tensor, state_table: torch.Tensor, entry_cache: torch.Tensor,
                      entry_table: torch.Tensor | None, seq: torch.Tensor, pos: torch.Tensor,
                      position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      inv_freq: torch.Tensor, rope_scaling: float, ratio: int, overlap: bool) -> None:
    """Pool and store the entry of every row whose position completes a window (see the
    module docstring); rows that complete none are skipped.

    state_cache: [NB, bs, 2, 1, C] (tensor 0 kv, tensor 1 raw gate; C = 2D with overlap, else D);
    state_table: [B, nb] its group's block table; entry_cache: [NBe, bse, 1, 1, D];
    entry_table: [B, nbe], or None: entry_cache is then [M, 1, 1, 1, D] and row m's entry goes
    to its row m (a caller that stores entries as records encodes them from there); seq, pos:
    [M] int (sequence row and position of each row);
    position_bias: [r, C] float32; norm_weight: [D] float32; inv_freq: [R/2] float32, R <= D.
    Caches may be any strided views with a contiguous last dim.
    """
    if state_cache.dim() != 5 or state_cache.shape[2] != 2 or state_cache.shape[3] != 1:
        raise ValueError(f"compress_entries_: state_cache must be [num_blocks, block_size, 2, 1, C], "
                         f"got shape {tuple(state_cache.shape)}")
    if entry_cache.dim() != 5 or entry_cache.shape[2] != 1 or entry_cache.shape[3] != 1:
        raise ValueError(f"compress_entries_: entry_cache must be [num_blocks, block_size, 1, 1, D], "
                         f"got shape {tuple(entry_cache.shape)}")
    d, c = entry_cache.shape[-1], state_cache.shape[-1]
    if c != (2 if overlap else 1) * d:
        raise ValueError(f"compress_entries_: state width C={c} must be {'2D' if overlap else 'D'} "
                         f"for D={d} (overlap={overlap})")
    if d % 2:
        raise ValueError(f"compress_entries_: the entry width D={d} must be even (RoPE pairs)")
    if ratio < 1:
        raise ValueError(f"compress_entries_: ratio must be >= 1, got {ratio}")
    if state_cache.stride(-1) != 1 or entry_cache.stride(-1) != 1:
        raise ValueError("compress_entries_: the caches' last dims must be contiguous")
    device = state_cache.device
    _check_table("state_table", state_table, device)
    m = seq.shape[0]
    row_out = entry_table is None
    if row_out:
        if entry_cache.shape[:2] != (m, 1):
            raise ValueError(f"compress_entries_: without an entry_table, entry_cache holds one row per row "
                             f"[M={m}, 1, 1, 1, D], got shape {tuple(entry_cache.shape)}")
        entry_table = state_table           # not read
    _check_table("entry_table", entry_table, device)
    for name, t in (("seq", seq), ("pos", pos)):
        if t.shape != (m,) or t.dtype not in (torch.int32, torch.int64) or t.device != device:
            raise ValueError(f"compress_entries_: {name} must be a [{m}] int32/int64 tensor on {device}, "
                             f"got {t.dtype} of shape {tuple(t.shape)} on {t.device}")
    if position_bias.shape != (ratio, c) or position_bias.dtype != torch.float32 or position_bias.stride(1) != 1:
        raise ValueError(f"compress_entries_: position_bias must be float32 [{ratio}, {c}] with a contiguous "
                         f"last dim, got {position_bias.dtype} {tuple(position_bias.shape)}")
    if norm_weight.shape != (d,) or norm_weight.dtype != torch.float32:
        raise ValueError(f"compress_entries_: norm_weight must be float32 [{d}], got "
                         f"{norm_weight.dtype} {tuple(norm_weight.shape)}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32 or not 0 < 2 * inv_freq.shape[0] <= d:
        raise ValueError(f"compress_entries_: inv_freq must be float32 [R/2] with 0 < R <= D={d}, got "
                         f"{inv_freq.dtype} {tuple(inv_freq.shape)}")
    for name, t in (("position_bias", position_bias), ("norm_weight", norm_weight), ("inv_freq", inv_freq)):
        if t.device != device:
            raise ValueError(f"compress_entries_: {name} is on {t.device}, the caches on {device}")
    if m == 0:
        return
    # Tile config: BLOCK_S slots per tile, a power of two dividing r (so a tile never
    # straddles the two halves of an overlapping window), capped at _TILE_ELEMS elements of
    # the channel vector; 8 warps for wide entries (D = 512), 4 below.
    block_half = triton.next_power_of_2(d // 2)
    block_s = min(ratio & -ratio, max(1, _TILE_ELEMS // (2 * block_half)))
    num_warps = 8 if d >= 512 else 4
    _compress_kernel[(m,)](
        state_cache, state_table, entry_cache, entry_table, seq.contiguous(), pos.contiguous(),
        position_bias, norm_weight.contiguous(), inv_freq.contiguous(),
        float(eps), float(rope_scaling),
        state_cache.stride(0), state_cache.stride(1), state_cache.stride(2),
        state_table.stride(0), state_table.stride(1),
        entry_cache.stride(0), entry_cache.stride(1),
        entry_table.stride(0), entry_table.stride(1),
        position_bias.stride(0),
        RATIO=ratio, SPAN=(2 if overlap else 1) * ratio, HEAD_DIM=d, ROPE_HALF=inv_freq.shape[0],
        STATE_BS=state_cache.shape[1], ENTRY_BS=entry_cache.shape[1],
        BLOCK_S=block_s, BLOCK_HALF=block_half, OVERLAP=overlap, ROW_OUT=row_out,
        num_warps=num_warps, **pdl.flags(state_cache.device))
