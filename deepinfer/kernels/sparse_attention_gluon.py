"""DeepSeek-V4 sparse attention at prefill, written in Gluon for Hopper (sm_90): the two
warpgroups split the score tile instead of both computing it, and the query's norm + rope
can run inside the kernel.

Why a second kernel beside ``sparse_attention.py``: there the chained QK -> PV dots make
Triton put all 8 warps along M (``warpsPerCTA = [8, 1]``). With M = 64 heads both
warpgroups then compute the whole 64 x BLOCK_N score tile, so the tensor cores do 1.5x the
useful work. Gluon lets the layouts be chosen by hand (FlashMLA's split):

- S = Q K^T [64, BLOCK_N]: warps [4, 2], each warpgroup computes BLOCK_N / 2 key columns;
- the row max and sum reduce across the two warpgroups (through shared memory);
- P goes to shared memory (bf16), and each warpgroup multiplies all of P by its half of the
  output columns: O [64, 512] with warps [4, 2] and 256-wide instructions.

Keys are gathered with cp.async into a two-buffer ring: tile i + 1 loads while tile i is
multiplied. The query is copied first, then the first key tile, so the tile flies while the
query is prepared.

With ``rope`` the kernel takes the raw query projection and applies what
``deepseek_v4_rope.q_norm_rope`` would have in a launch of its own (one read and one write of
[T, 64, 512] fewer), with the same numerics: the per-head RMS factor in float32 applied in
bf16, the rotation in float32 on the rounded normed values. It does so in shared memory,
after the copy. (Rotating the output back in the epilogue as well was tried: with one
program per SM its extra round trip through memory is not hidden, and the kernel got slower
than the separate inverse-rope launch.)

It is launched without programmatic dependent launch (``pdl.py``): Gluon in triton 3.6 has
no ``griddepcontrol.wait``, and a plain launch is ordered after the previous kernel.

Gluon has no CPU interpreter: this kernel is tested on the GPU only
(``tests/kernels/test_sparse_attention_gluon.py``, ``-m gpu``), against the same references
as the Triton kernel, which stays the implementation everywhere else (CPU interpreter,
decode, other shapes, ``DEEPINFER_GLUON_ATTENTION=0``).

Contract: as :func:`sparse_attention.sparse_attention` for q [T, 64, 512] bf16 with
contiguous heads and one or two sources (cache [NB, bs, nt, 1, 512] bf16, tensor 0 read;
slots [T, K] int32 or int64 with unit column stride, -1 for none); sinks [64] float32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

_LOG2E = 1.4426950408889634
HEADS, HEAD_DIM = 64, 512
# Widest slot row whose trim scan is one load (compiled for sm_90 at 512, 2048 and 8192 slots
# with the same 254 registers: the scan runs before the accumulator is live). 8192 covers the
# HCA entries of a 1M-token context; wider rows take the Triton kernel, which loops its scan.
MAX_SLOTS = 8192


class QueryRope(NamedTuple):
    """What the query prologue needs: positions [T] (int32/int64), inv_freq [R/2]
    float32, the rope's scaling factor and the q norm's eps."""
    positions: torch.Tensor
    inv_freq: torch.Tensor
    scaling: float
    eps: float


@gluon.jit
def _normalise_query(q_smem, pos, inv_freq_ptr, rope_scaling, eps, ROPE_HALF: gl.constexpr,
                     LOAD: gl.constexpr, ROPE: gl.constexpr, ANGLES: gl.constexpr):
    """In place in shared memory: q <- rope(q / rms(q)) per head, as
    ``deepseek_v4_rope.q_norm_rope`` computes it. First the norm, 16 heads at a time; then the
    rope on the trailing 2 * ROPE_HALF columns of all heads at once, so each thread computes
    the cos/sin of only a few columns. Columns (2i, 2i+1) rotate together; ROPE holds pairs
    in one thread, so a column's partner (col ^ 1) is a register select. The angle is the
    float32 ``pos * inv_freq`` reduced to [-pi, pi] in float64."""
    CHUNK: gl.constexpr = 16
    for c in gl.static_range(64 // CHUNK):
        rows = q_smem.slice(c * CHUNK, CHUNK, dim=0)
        x = rows.load(LOAD).to(gl.float32)
        rstd = gl.rsqrt(gl.sum(x * x, axis=1)[:, None] / 512 + eps)
        rows.store((x * rstd.to(gl.bfloat16).to(gl.float32)).to(gl.bfloat16))   # in q's dtype
    gl.thread_barrier()                                # the normed rows, before other threads read them
    rope = q_smem.slice(512 - 2 * ROPE_HALF, 2 * ROPE_HALF, dim=1)
    y = rope.load(ROPE).to(gl.float32)                 # [64, 2 * ROPE_HALF]
    # The angles depend on the column only: computed once per column in a layout that gives
    # each thread at most two (ANGLES), then spread to ROPE's columns. (Computed in ROPE's
    # column slice, every thread evaluated 8 of them: float64 reduction, cos and sin each,
    # about a third of the prologue.)
    a_cols = gl.arange(0, 2 * ROPE_HALF, layout=ANGLES)
    freq = pos * gl.load(inv_freq_ptr + a_cols // 2)
    two_pi = gl.full([2 * ROPE_HALF], 6.283185307179586, gl.float64, layout=ANGLES)
    inv_two_pi = gl.full([2 * ROPE_HALF], 0.15915494309189535, gl.float64, layout=ANGLES)
    f64 = freq.to(gl.float64)
    angle = (f64 - gl.floor(f64 * inv_two_pi + 0.5) * two_pi).to(gl.float32)
    a_cos = gl.cos(angle) * rope_scaling
    a_sin = gl.sin(angle) * rope_scaling * gl.where((a_cols % 2) == 1, 1.0, -1.0)   # even: x cos - x' sin
    cos = gl.convert_layout(a_cos, gl.SliceLayout(0, ROPE))[None, :]
    sin = gl.convert_layout(a_sin, gl.SliceLayout(0, ROPE))[None, :]
    cols = gl.arange(0, 2 * ROPE_HALF, layout=gl.SliceLayout(0, ROPE))[None, :]
    partner = gl.full([64, 2 * ROPE_HALF], 0, gl.int32, layout=ROPE) + (cols + 1 - 2 * (cols % 2))
    rope.store((y * cos + gl.gather(y, partner, 1) * sin).to(gl.bfloat16))


@gluon.jit
def _slot_range(slots_ptr, token, stride_slots_t, k, BLOCK_N: gl.constexpr, BLOCK_SCAN: gl.constexpr,
                SCAN: gl.constexpr):
    """First tile start, last valid slot index and number of BLOCK_N tiles of the token's slot
    row, trimming leading and trailing -1 runs (one load of the row)."""
    jj = gl.arange(0, BLOCK_SCAN, layout=SCAN)
    row_slots = gl.load(slots_ptr + token * stride_slots_t + jj, mask=jj < k, other=-1)
    first = gl.min(gl.where(row_slots >= 0, jj, k), axis=0)
    last = gl.max(gl.where(row_slots >= 0, jj, -1), axis=0)
    first = first // BLOCK_N * BLOCK_N
    return first, last, gl.cdiv(last + 1 - first, BLOCK_N)


@gluon.jit
def _gather_slots(slots_ptr, token, stride_slots_t, n0, last, BLOCK_N: gl.constexpr, GATHER: gl.constexpr):
    """Slots n0 .. n0 + BLOCK_N - 1 of the token's row (-1 past ``last``), in the gather's row layout."""
    j = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GATHER))
    return gl.load(slots_ptr + token * stride_slots_t + j, mask=j <= last, other=-1)


@gluon.jit
def _copy_rows(cache_ptr, slot, stride_cache_block, stride_cache_offset, kv_buf, BLOCK_SIZE: gl.constexpr,
               GATHER: gl.constexpr):
    """cp.async of the keys of ``slot`` (those >= 0) into kv_buf."""
    valid = slot >= 0
    slot = gl.where(valid, slot, 0)
    row = (slot // BLOCK_SIZE).to(gl.int64) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_offset
    dims = gl.arange(0, 512, layout=gl.SliceLayout(0, GATHER))
    async_copy.async_copy_global_to_shared(kv_buf, cache_ptr + row[:, None] + dims[None, :], mask=valid[:, None])
    async_copy.commit_group()


@gluon.jit
def _issue_gather(cache_ptr, slots_ptr, token, stride_slots_t, stride_cache_block, stride_cache_offset,
                  n0, last, kv_buf, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
                  GATHER: gl.constexpr):
    """cp.async of the keys of slots n0 .. n0 + BLOCK_N - 1 (those <= last and >= 0) into kv_buf."""
    slot = _gather_slots(slots_ptr, token, stride_slots_t, n0, last, BLOCK_N, GATHER)
    _copy_rows(cache_ptr, slot, stride_cache_block, stride_cache_offset, kv_buf, BLOCK_SIZE, GATHER)


@gluon.jit
def _attend_tiles(q_smem, kv_smem, p_smem, m, l_acc, acc, cache_ptr, slots_ptr, token, stride_slots_t,
                  stride_cache_block, stride_cache_offset, qk_scale, first, last, n_tiles,
                  BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr,
                  O_LAYOUT: gl.constexpr, GATHER: gl.constexpr):
    """Online softmax over the source's tiles; tile 0's gather was issued by the caller.

    The softmax denominator is kept per score column (``l_acc`` [64, BLOCK_N]) and summed
    across the warpgroups once, by the caller, instead of every tile; the slot ids of tile
    i + 1's gather are loaded during tile i, so the gather issues without waiting on a load.
    (H200, T=4096, window + top-512 with the query prologue: 1,046 -> 1,004 us, the loops
    side by side behind a constexpr; ``scripts/probes/gluon_attention_ab.py`` now compares
    the kernel with older copies of this file.)"""
    zero_s = gl.zeros([64, BLOCK_N], gl.float32, S_LAYOUT)
    nxt = _gather_slots(slots_ptr, token, stride_slots_t, first + BLOCK_N, last, BLOCK_N, GATHER)
    for i in range(n_tiles):
        buf = i % 2
        kv = kv_smem.index(buf)
        # Tile i has landed (each thread waits for its own copies; the barrier makes
        # everyone's visible, and means every warp is done with tile i - 1's buffer and P).
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        if i + 1 < n_tiles:
            _copy_rows(cache_ptr, nxt, stride_cache_block, stride_cache_offset, kv_smem.index(1 - buf),
                       BLOCK_SIZE, GATHER)
            nxt = _gather_slots(slots_ptr, token, stride_slots_t, first + (i + 2) * BLOCK_N, last,
                                BLOCK_N, GATHER)
        s = warpgroup_mma(q_smem, kv.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        j = first + i * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        slot = gl.load(slots_ptr + token * stride_slots_t + j, mask=j <= last, other=-1)
        s = gl.where((slot >= 0)[None, :], s * qk_scale, float("-inf"))
        m_new = gl.maximum(m, gl.max(s, axis=1))       # the sinks seed m: finite
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_acc = l_acc * alpha[:, None] + p
        m = m_new
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
        acc = warpgroup_mma(p_smem, kv, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return m, l_acc, acc


@gluon.jit
def _sparse_prefill_kernel(
    q_ptr, sinks_ptr, out_ptr, cache0_ptr, slots0_ptr, cache1_ptr, slots1_ptr,
    pos_ptr, inv_freq_ptr, rope_scaling, eps,
    k0, k1, qk_scale, stride_q_t, stride_out_t,
    stride_slots0_t, stride_cache0_block, stride_cache0_offset,
    stride_slots1_t, stride_cache1_block, stride_cache1_offset,
    BLOCK_SIZE0: gl.constexpr, BLOCK_SIZE1: gl.constexpr, TWO_SOURCES: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_SCAN: gl.constexpr, ROPE: gl.constexpr, ROPE_HALF: gl.constexpr,
):
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_N // 2, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, 256, 16])
    # 16-byte pieces, a warp over 2 rows x 128 columns, 8 warps over 16 rows.
    GATHER: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [8, 1], [1, 0])
    SCAN: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])
    # The query's rope columns: a pair of columns per thread, 8 warps over 32 rows x 16 columns.
    ROPE_PAIRS: gl.constexpr = gl.BlockedLayout([1, 2], [4, 8], [8, 1], [1, 0])
    QK_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    P_SMEM: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.bfloat16)

    token = gl.program_id(0).to(gl.int64)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], QK_SMEM)
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, 512], QK_SMEM)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [64, BLOCK_N], P_SMEM)

    # q's copy, then source 0's first tile: the tile flies while the query is normalised.
    heads = gl.arange(0, 64, layout=gl.SliceLayout(1, GATHER))
    dims = gl.arange(0, 512, layout=gl.SliceLayout(0, GATHER))
    async_copy.async_copy_global_to_shared(q_smem, q_ptr + token * stride_q_t + heads[:, None] * 512 + dims[None, :])
    async_copy.commit_group()
    first, last, n_tiles = _slot_range(slots0_ptr, token, stride_slots0_t, k0, BLOCK_N, BLOCK_SCAN, SCAN)
    if n_tiles > 0:
        _issue_gather(cache0_ptr, slots0_ptr, token, stride_slots0_t, stride_cache0_block,
                      stride_cache0_offset, first, last, kv_smem.index(0), BLOCK_SIZE0, BLOCK_N, GATHER)
    if ROPE:
        if n_tiles > 0:
            async_copy.wait_group(1)
        else:
            async_copy.wait_group(0)
        gl.thread_barrier()                            # every thread's part of q has landed
        pos = gl.load(pos_ptr + token).to(gl.float32)
        _normalise_query(q_smem, pos, inv_freq_ptr, rope_scaling, eps, ROPE_HALF, GATHER, ROPE_PAIRS, SCAN)

    m = gl.load(sinks_ptr + gl.arange(0, 64, layout=gl.SliceLayout(1, S_LAYOUT))) * 1.4426950408889634
    acc = gl.zeros([64, 512], gl.float32, O_LAYOUT)
    # Per-column softmax sums; the sink's term (1 at m = the sink) rides in column 0.
    s_cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    l_acc = gl.where(s_cols[None, :] == 0, 1.0, 0.0) + gl.zeros([64, BLOCK_N], gl.float32, S_LAYOUT)
    m, l_acc, acc = _attend_tiles(q_smem, kv_smem, p_smem, m, l_acc, acc, cache0_ptr, slots0_ptr, token,
                                  stride_slots0_t, stride_cache0_block, stride_cache0_offset, qk_scale,
                                  first, last, n_tiles, BLOCK_SIZE0, BLOCK_N, S_LAYOUT, O_LAYOUT, GATHER)
    if TWO_SOURCES:
        first, last, n_tiles = _slot_range(slots1_ptr, token, stride_slots1_t, k1, BLOCK_N, BLOCK_SCAN, SCAN)
        gl.thread_barrier()                            # every warp is done with source 0's buffers
        if n_tiles > 0:
            _issue_gather(cache1_ptr, slots1_ptr, token, stride_slots1_t, stride_cache1_block,
                          stride_cache1_offset, first, last, kv_smem.index(0), BLOCK_SIZE1, BLOCK_N, GATHER)
        m, l_acc, acc = _attend_tiles(q_smem, kv_smem, p_smem, m, l_acc, acc, cache1_ptr, slots1_ptr, token,
                                      stride_slots1_t, stride_cache1_block, stride_cache1_offset, qk_scale,
                                      first, last, n_tiles, BLOCK_SIZE1, BLOCK_N, S_LAYOUT, O_LAYOUT, GATHER)
    l = gl.sum(l_acc, axis=1)
    async_copy.wait_group(0)                           # q's copy, if no tile waited for it
    out = acc / gl.convert_layout(l, gl.SliceLayout(1, O_LAYOUT))[:, None]
    oh = gl.arange(0, 64, layout=gl.SliceLayout(1, O_LAYOUT))
    od = gl.arange(0, 512, layout=gl.SliceLayout(0, O_LAYOUT))
    gl.store(out_ptr + token * stride_out_t + oh[:, None] * 512 + od[None, :], out.to(gl.bfloat16))


def supported(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether :func:`sparse_attention_prefill` takes these tensors: a Hopper GPU, q [T, 64, 512]
    bf16 with contiguous heads, one or two bf16 sources of one-head 512-wide rows, integer
    slots with unit column stride."""
    if not (q.is_cuda and q.dim() == 3 and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False
    t, h, d = q.shape
    if (h, d) != (HEADS, HEAD_DIM) or q.dtype != torch.bfloat16 or q.stride(1) != d or q.stride(2) != 1:
        return False
    if not 1 <= len(sources) <= 2:
        return False
    for cache, slots in sources:
        if (slots.dim() != 2 or slots.shape[1] > MAX_SLOTS or slots.stride(1) != 1
                or slots.dtype not in (torch.int32, torch.int64) or cache.dtype != torch.bfloat16
                or cache.dim() != 5 or cache.shape[3:] != (1, d) or cache.stride(-1) != 1):
            return False
    return True


def sparse_attention_prefill(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]],
                             sinks: torch.Tensor, scale: float, rope: QueryRope | None = None,
                             block_n: int = 64) -> torch.Tensor:
    """Softmax attention of each token over the keys its slot rows name (one program per
    token, no splits). With ``rope``, q is the raw query projection: the kernel applies
    :func:`reference.q_norm_rope` to it first. Callers check :func:`supported` first."""
    if not supported(q, sources):
        raise ValueError("sparse_attention_prefill: needs an sm_90 GPU, q [T, 64, 512] bf16 with contiguous "
                         "heads and one or two bf16 [NB, bs, 1, 1, 512] caches with integer slots; got q "
                         f"{q.dtype} {tuple(q.shape)}")
    t = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    (c0, s0), (c1, s1) = sources[0], sources[-1]
    if rope is not None:
        pos, inv_freq, rope_scaling, eps = rope
        half = inv_freq.shape[0]
        if (inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or half & (half - 1)
                or not 8 <= half <= HEAD_DIM // 2 or pos.shape != (t,)):
            raise ValueError(f"sparse_attention_prefill: rope needs positions [T={t}] and a float32 inv_freq "
                             f"[R/2] with R/2 a power of 2 in [8, {HEAD_DIM // 2}], got positions "
                             f"{tuple(pos.shape)} and inv_freq {inv_freq.dtype} {tuple(inv_freq.shape)}")
        inv_freq = inv_freq.contiguous()
    else:
        pos, inv_freq, rope_scaling, eps, half = s0, sinks, 1.0, 0.0, 1      # never read
    scan = triton.next_power_of_2(max(s0.shape[1], s1.shape[1]))
    _sparse_prefill_kernel[(t,)](
        q, sinks, out, c0, s0, c1, s1, pos, inv_freq, float(rope_scaling), float(eps),
        s0.shape[1], s1.shape[1], scale * _LOG2E, q.stride(0), out.stride(0),
        s0.stride(0), c0.stride(0), c0.stride(1), s1.stride(0), c1.stride(0), c1.stride(1),
        BLOCK_SIZE0=c0.shape[1], BLOCK_SIZE1=c1.shape[1], TWO_SOURCES=len(sources) == 2,
        BLOCK_N=block_n, BLOCK_SCAN=scan, ROPE=rope is not None, ROPE_HALF=half, num_warps=8)
    return out
