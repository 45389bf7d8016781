"""Block-scaled FP8 GEMM for the dense projections, with activations quantised on the fly;
references: :func:`reference.fp8_act_quant`, :func:`reference.fp8_block_gemm`,
:func:`reference.fp8_linear`.

What belongs here: the two kernels of ``y = x @ W^T`` with W stored as shipped (``float8_e4m3fn``
[N, K] and one scale per ``block_n x block_k`` tile, [ceil(N/block_n), K/block_k]) and their
launchers. What does not: choosing which weights are FP8 or quantising them (``models/quant.py``,
``layers/quant_linear.py``).

* act quant (grid M x K/group): each token's K inputs in groups of ``group`` (1 x 128, as
  DeepSeek's kernels) get the float32 scale ``s = max(amax, 1e-4) / 448`` (``pow2_scale``: rounded
  up to a power of two, the UE8M0 convention) and are stored as e4m3 ``round(x / s)``.
* GEMM (grid M-tiles x N-tiles): FP8 tensor-core products over K steps of
  ``BLOCK_K = min(group, block_k)``; each step's float32 partial product is multiplied by the
  token's activation scale and the output column's weight scale of that step, then accumulated
  in float32 (DeepSeek's fp8_gemm does the same with 128-wide steps). V4's 128 x 128 weight
  scales give 128-wide steps; V4.1's 32 x 32 ones 32-wide steps, the narrowest FP8 MMA, with
  one activation scale spanning four of them.
* Two launches, not one: quantising the activations inside the GEMM saves a launch but makes
  every N-tile quantise the M x K activations again; on an H100 at the V4-Flash projections that
  took 15-190 us at M = 1 against 5-14 us for the act-quant launch plus the GEMM
  (``scripts/probes/fp8_gemm_variants.py``; the fused variant is in this file's git history), so
  the GEMM reads e4m3 codes.
* Split K (grid M-tiles x N-tiles x S): when the output tiles alone leave SMs idle (decode at
  N = 512 / 1024; up to 16 rows, up to two waves of programs), S slices of K (:func:`pick_split`, a power of two dividing the groups) each
  store a float32 partial; the tile's last slice to finish (an int32 counter per tile, taken
  with an acquire-release atomic and put back to zero, so CUDA-graph replays find it zeroed)
  adds the S partials in slice order 0, 1, ... and writes the output. The order is fixed, so
  the result does not depend on which program finishes last (no float atomics), and no second
  launch is needed: the partials, S x M x N float32, are small next to the weight bytes at the
  sizes that split. Batch-invariant mode picks S from N and K alone, the same for every M, so
  it splits prefill too: S x M x N float32 partials (64 MB for N = 512 at 4096 tokens, S = 8).

Weight scales are float32 or UE8M0 bytes (``uint8``, ``2 ** (b - 127)``, decoded in registers
from their bits).

Accuracy. Against ``x @ dequant(W)^T`` in float32 the only error is the activations' rounding to
e4m3 (3 mantissa bits: relative error at most 2^-4 per element, about 2^-4/sqrt(3) RMS); the
weights enter exactly. On random data the output's relative Frobenius error is about 0.025
(tests allow 0.05); against the FP8 reference on the same quantised operands it is rounding only
(float32 accumulation order, then the output dtype).

Shapes: M tokens, K input width, N output width.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.launch import sm_count, tile_counters


@triton.jit
def _round_e4m3(v):
    """float32 v in [-448, 448] rounded to the nearest e4m3 value (ties to even), still float32.
    The cast alone would do it on the GPU; the CPU interpreter's float32 -> e4m3 cast mis-rounds
    values just below a power of two, and the cast of an already representable value is exact
    everywhere. The exponent comes from the bits (exact); the rounding is float32's own
    round-to-nearest-even, by adding and subtracting 1.5 * 2^23."""
    e = tl.maximum(((v.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)   # subnormals: 2^-9 steps
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)                   # 3 mantissa bits
    inv_ulp = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)             # exact products
    return ((v * inv_ulp + 12582912.0) - 12582912.0) * ulp


@triton.jit
def _group_scale(amax, POW2: tl.constexpr):
    """The float32 scale of an activation group with absolute maximum ``amax``."""
    # Correctly rounded divisions (``/`` on the GPU is approximate), so the scales and codes are
    # the reference's bit for bit.
    s = tl.div_rn(tl.maximum(amax, 1e-4), 448.0)
    if POW2:
        # 2 ** ceil(log2(s)) from the bits (exact; the hardware log2 is approximate): the exponent,
        # plus one unless the mantissa is zero.
        bits = s.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        s = (e << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _quant_codes(x, s):
    """float32 x divided by its group's scale s, as e4m3."""
    return _round_e4m3(tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0)).to(tl.float8e4nv)


@triton.jit
def quant_groups(y, GROUP: tl.constexpr, POW2: tl.constexpr):
    """A float32 row tile y [BLOCK] (BLOCK a multiple of ``GROUP``) quantised per ``GROUP``
    inputs exactly as the act-quant kernel quantises a row: (e4m3 codes [BLOCK], float32 scales
    [BLOCK / GROUP]). For kernels whose output feeds an FP8 linear (the norms, the SwiGLU): they
    store both and the linear skips its act-quant launch (``layers/quant_linear.py``)."""
    BLOCK: tl.constexpr = y.shape[0]
    g = tl.reshape(y, [BLOCK // GROUP, GROUP])
    s = _group_scale(tl.max(tl.abs(g), axis=1), POW2)
    return tl.reshape(_quant_codes(g, s[:, None]), [BLOCK]), s


@triton.jit
def store_quant_groups(y, q_row, s_row, first_col, n_cols, GROUP: tl.constexpr, POW2: tl.constexpr):
    """Quantise a float32 tile y [BLOCK] of a row's columns ``first_col ..`` (``first_col`` a
    multiple of ``GROUP``) with :func:`quant_groups` and store its codes at ``q_row`` (the row's
    [n_cols] e4m3 codes) and its scales at ``s_row`` (the row's [n_cols / GROUP] scales); columns
    from ``n_cols`` on are not stored."""
    BLOCK: tl.constexpr = y.shape[0]
    q, s = quant_groups(y, GROUP, POW2)
    cols = first_col + tl.arange(0, BLOCK)
    tl.store(q_row + cols, q, mask=cols < n_cols)
    groups = first_col // GROUP + tl.arange(0, BLOCK // GROUP)
    tl.store(s_row + groups, s, mask=groups < n_cols // GROUP)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, stride_s,
                      GROUP: tl.constexpr, POW2: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_x + cols).to(tl.float32)
    s = _group_scale(tl.max(tl.abs(x), axis=0), POW2)
    tl.store(q_ptr + row * stride_q + cols, _quant_codes(x, s))
    tl.store(s_ptr + row * stride_s + g, s)


def check_quant_group(group: int, k: int, who: str = "fp8_act_quant") -> None:
    """An activation group must be a power of two >= 16 dividing the row width K."""
    if group < 16 or group & (group - 1) or k % group:
        raise ValueError(f"{who}: group={group} must be a power of two >= 16 dividing K={k}")


def fp8_act_quant(x: torch.Tensor, group: int = 128, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of ``group``, a power of two >= 16) -> (e4m3 [M, K], float32 scales
    [M, K/group]); see :func:`reference.fp8_act_quant`."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"fp8_act_quant: x must be [M, K] with unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    m, k = x.shape
    check_quant_group(group, k)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    if m:
        _act_quant_kernel[(m, k // group)](x, q, s, x.stride(0), q.stride(0), s.stride(0),
                                           GROUP=group, POW2=pow2_scale, num_warps=1 if group <= 128 else 4,
                                           **pdl.flags(x.device))
    return q, s


@triton.jit
def _scaled_step(acc, a, sa, w_ptrs, ws_ptrs, col_ok, W_E8M0: tl.constexpr):
    """One K step: acc + (a @ w) * (activation scale x weight scale), a [BLOCK_M, BLOCK_K] e4m3,
    sa [BLOCK_M], w_ptrs [BLOCK_K, BLOCK_N], ws_ptrs [BLOCK_N] the step's weight scales."""
    b = tl.load(w_ptrs, mask=col_ok[None, :], other=0.0)
    sw = tl.load(ws_ptrs, mask=col_ok, other=0)
    if W_E8M0:
        sw = (sw.to(tl.int32) << 23).to(tl.float32, bitcast=True)               # 2 ** (b - 127)
    return acc + tl.dot(a, b) * (sa[:, None] * sw[None, :])


@triton.jit
def _gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, part_ptr, count_ptr, m, n, k,
                 stride_a, stride_as, stride_w, stride_ws, stride_out, stride_part,
                 GROUP: tl.constexpr, WBN: tl.constexpr, WBK: tl.constexpr, W_E8M0: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT: tl.constexpr = 1, GROUP_N: tl.constexpr = 0, ADD: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    pdl.enter(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if GROUP_N > 0:
        # Block-diagonal (grouped) weight: output columns [g * GROUP_N, (g + 1) * GROUP_N) read
        # activation columns [g * k, (g + 1) * k) (a tile lies in one group: GROUP_N % BLOCK_N == 0).
        grp = (pid_n * BLOCK_N // GROUP_N).to(tl.int64)
        a_ptr += grp * k
        as_ptr += grp * (k // GROUP)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                            # [BLOCK_M] of M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                            # [BLOCK_N] of N
    row_ok, col_ok = rows < m, cols < n
    # This program's K slice: ``steps`` K steps from step s0 on (all of K unless split; a slice is
    # whole activation groups).
    steps = k // BLOCK_K // SPLIT
    s0 = tl.program_id(2) * steps
    ks = s0 * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_a + ks[None, :]    # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None]    # [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + rows.to(tl.int64) * stride_as                         # [BLOCK_M]
    ws_ptrs = ws_ptr + (cols // WBN).to(tl.int64) * stride_ws                # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(s0, s0 + steps):
        k0 = step * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        sa = tl.load(as_ptrs + k0 // GROUP, mask=row_ok, other=0.0)
        acc = _scaled_step(acc, a, sa, w_ptrs, ws_ptrs + k0 // WBK, col_ok, W_E8M0)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_mask = row_ok[:, None] & col_ok[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :]
    if SPLIT == 1:
        if ADD:                                       # out += the product, rounded once
            acc += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Split K: each slice stores its float32 partial [SPLIT, M, N]; the tile's last slice to
        # finish adds them in slice order 0, 1, ... (the same sums whichever program is last) and
        # puts the tile's counter back to zero for the next launch or CUDA-graph replay.
        offs = rows[:, None].to(tl.int64) * n + cols[None, :]
        tl.store(part_ptr + tl.program_id(2).to(tl.int64) * stride_part + offs, acc, mask=out_mask)
        tl.debug_barrier()                       # every thread's partial is written before the count
        tile = pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            total = tl.load(part_ptr + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                total += tl.load(part_ptr + s * stride_part + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            if ADD:
                total += tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


MAX_SPLIT = 8
"""The most K slices a small-N GEMM is split into."""

SMALL_M_WAVES = 2
"""Up to 16 rows, split K may launch this many waves of programs (tiles x S <= 2 x SMs): at M = 1
and 16 on an H100, two slices of N = 4096 projections (128 tiles) took 14.2 / 8.8 / 6.2 us (o_b,
gate_up, down) against 20.6 / 12.6 / 6.7 us unsplit; at M = 64 the unsplit GEMM was as fast or
faster."""

def pick_tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Decode (M <= 64) streams the weights: M-tiles
    the batch's size (16 at least, the MMA minimum) and N-tiles narrow enough that the N / BLOCK_N
    programs cover the SMs at the V4 widths (N >= 1024). Prefill: 128 x 128 tiles."""
    if m <= 64:
        block_m = max(16, triton.next_power_of_2(m))
        block_n = 64 if n >= 8192 else 32
        tiles = (block_m, block_n, 4, 4)
    else:
        tiles = (128, 128, 8, 3)
    block_n = min(tiles[1], max(16, triton.next_power_of_2(n)))
    return tiles[0], block_n, tiles[2], tiles[3]


def pick_split(tiles: int, chunks: int, sms: int, max_split: int = MAX_SPLIT) -> int:
    """K slices for a GEMM of ``tiles`` output tiles over ``chunks`` activation groups: the largest
    power of two S <= ``max_split`` with tiles * S programs still within the ``sms`` SMs, S dividing
    the groups and every slice at least two groups long. 1 when the tiles alone fill the GPU."""
    s = 1
    while (2 * s <= max_split and tiles * 2 * s <= sms and chunks % (2 * s) == 0
           and chunks // (2 * s) >= 2):
        s *= 2
    return s


def default_split(m: int, m_tiles: int, n_tiles: int, chunks: int, sms: int, invariant: bool) -> int:
    """The launch's K slices: :func:`pick_split` over the output tiles within one wave of ``sms``
    programs, or :data:`SMALL_M_WAVES` waves up to 16 rows. Batch-invariant mode: from the N-tiles
    and one wave alone, the same S for every M (as if one M-tile), so every row's sums are too."""
    if invariant:
        return pick_split(n_tiles, chunks, sms)
    return pick_split(m_tiles * n_tiles, chunks, sms * (SMALL_M_WAVES if m <= 16 else 1))


def _check_weight(w: torch.Tensor, ws: torch.Tensor, block: tuple[int, int], k: int) -> None:
    bn, bk = block
    n = w.shape[0]
    if w.dtype != torch.float8_e4m3fn or w.dim() != 2 or w.shape[1] != k or w.stride(1) != 1:
        raise ValueError(f"fp8_gemm: weight must be float8_e4m3fn [N, K={k}] with unit column stride, got "
                         f"{w.dtype} shape {tuple(w.shape)} strides {w.stride()}")
    grid = (-(-n // bn), k // bk)
    if k % bk or tuple(ws.shape) != grid or ws.stride(1) != 1:
        raise ValueError(f"fp8_gemm: weight [N={n}, K={k}] in {bn}x{bk} blocks needs contiguous scales of "
                         f"shape {grid} (K a multiple of {bk}), got shape {tuple(ws.shape)}")
    if ws.dtype not in (torch.float32, torch.uint8):
        raise ValueError(f"fp8_gemm: weight scales must be float32 or UE8M0 bytes (uint8), got {ws.dtype}")


def _k_step(group: int, block_k: int) -> int:
    step = min(group, block_k)
    if step < 32 or step & (step - 1):
        raise ValueError(f"fp8_gemm: the K step min(group={group}, block_k={block_k}) must be a power of "
                         "two >= 32")
    return step


def _gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
          block: tuple[int, int], group: int, out_dtype: torch.dtype, invariant: bool,
          split: int | None, tiles: tuple[int, int, int, int] | None, groups: int = 1,
          add_to: torch.Tensor | None = None) -> torch.Tensor:
    """The GEMM launch: ``a`` e4m3 with ``a_scale`` (one per ``group`` inputs). ``groups`` > 1: a
    [M, groups * K] against the block-diagonal weight w [N, K] whose g-th N / groups rows read a's
    g-th K columns. ``add_to`` [M, N] (unit column stride): the product is added to it in
    float32 and written back into it, rounded once."""
    m, k = a.shape[0], a.shape[1] // groups
    n = w.shape[0]
    block_k = _k_step(group, block[1])
    if add_to is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    elif add_to.shape != (m, n) or add_to.stride(1) != 1 or add_to.dtype != out_dtype:
        raise ValueError(f"fp8_gemm: the residual must be {out_dtype} [M={m}, N={n}] with unit column stride, "
                         f"got {add_to.dtype} {tuple(add_to.shape)} strides {add_to.stride()}")
    else:
        out = add_to
    if m == 0 or n == 0:
        return out
    bm, bn, warps, stages = tiles or pick_tiles(64 if invariant else m, n)
    if groups > 1:
        bn = min(bn, group_tile_n(n // groups))
    m_tiles, n_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn)
    chunks = k // group
    if split is None:
        split = default_split(m, m_tiles, n_tiles, chunks, sm_count(a.device), invariant)
    if split < 1 or split & (split - 1) or chunks % split:
        raise ValueError(f"fp8_gemm: split={split} must be a power of two dividing the K/group={chunks} groups")
    part = torch.empty(split, m, n, dtype=torch.float32, device=a.device) if split > 1 else out
    counts = tile_counters(a.device, m_tiles * n_tiles) if split > 1 else out
    _gemm_kernel[(m_tiles, n_tiles, split)](
        a, a_scale, w, ws, out, part, counts, m, n, k,
        a.stride(0), a_scale.stride(0), w.stride(0), ws.stride(0), out.stride(0), m * n,
        GROUP=group, WBN=block[0], WBK=block[1], W_E8M0=ws.dtype == torch.uint8,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, SPLIT=split,
        GROUP_N=n // groups if groups > 1 else 0, ADD=add_to is not None, num_warps=warps, num_stages=stages,
        **pdl.flags(a.device))
    return out


def group_tile_n(group_n: int) -> int:
    """The widest N-tile (a power of two, 16 to 128) that divides a grouped weight's ``group_n``
    output rows a group, so no tile straddles two groups."""
    bn = 128
    while bn > 16 and group_n % bn:
        bn //= 2
    if group_n % bn:
        raise ValueError(f"fp8_gemm: a grouped weight's {group_n} output rows a group must be a multiple of 16")
    return bn


def fp8_block_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype, invariant: bool = False, *,
                   split: int | None = None, tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """(xq [M, K] e4m3, xs [M, K/group] float32) x (w [N, K] e4m3, ws [N/bn, K/bk] float32 or
    UE8M0 bytes) -> [M, N] in ``out_dtype``; see :func:`reference.fp8_block_gemm`. ``group`` is
    K / xs.shape[1]; it and ``block``'s bk must be powers of two >= 32 dividing K (the FP8 MMA's
    reduction is 32 wide). ``invariant`` (batch-invariant mode): the tiles of M = 64 and one K split
    for every M. ``split`` (K slices, default :func:`pick_split`) and ``tiles`` (default
    :func:`pick_tiles`) override the launch configuration."""
    m, k = xq.shape
    _check_weight(w, ws, block, k)
    if xs.dim() != 2 or xs.shape[0] != m or xs.shape[1] == 0 or k % xs.shape[1]:
        raise ValueError(f"fp8_gemm: activation scales must be [M={m}, K/group], got {tuple(xs.shape)}")
    return _gemm(xq, xs, w, ws, block, k // xs.shape[1], out_dtype, invariant, split, tiles)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, block: tuple[int, int],
               group: int = 128, pow2_scale: bool = False, invariant: bool = False, *,
               split: int | None = None,
               tiles: tuple[int, int, int, int] | None = None, groups: int = 1,
               quantized: tuple[torch.Tensor, torch.Tensor] | None = None,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequant(w, ws)^T`` with x quantised per 1 x ``group`` on the fly: x [..., K] -> [..., N]
    in x's dtype; see :func:`reference.fp8_linear`. ``split`` and ``tiles`` as
    :func:`fp8_block_gemm`. ``groups`` > 1: a block-diagonal weight (DeepSeek-V4's grouped
    ``wo_a``), x [..., groups, K] -> [..., groups, N / groups], group g's inputs times w's g-th
    N / groups rows, in one launch. ``quantized``: x's codes and scales as :func:`fp8_act_quant`
    makes them (the producer of x stored them), so no act-quant launch runs. ``residual`` [..., N]
    (ungrouped): the product is added to it in the GEMM's epilogue (in float32, rounded once) and
    it is returned, instead of a new output and a separate add."""
    k = x.shape[-1]
    if groups > 1:
        if x.dim() < 2 or x.shape[-2] != groups or w.shape[0] % groups:
            raise ValueError(f"fp8_gemm: a grouped linear takes x [..., groups={groups}, K] and N a multiple "
                             f"of the groups, got x {tuple(x.shape)} and w {tuple(w.shape)}")
        x2 = x.reshape(-1, groups * k)
    else:
        x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    check_quant_group(group, k)
    _check_weight(w, ws, block, k)
    # Groups of ``group`` inputs never straddle two weight groups (K is a multiple of them), so
    # the whole row quantises as each group's inputs would.
    if quantized is None:
        xq, xs = fp8_act_quant(x2, group, pow2_scale)
    else:
        xq, xs = quantized
        if groups > 1 or xq.shape != x2.shape or xs.shape != (x2.shape[0], k // group):
            raise ValueError(f"fp8_gemm: quantized activations {tuple(xq.shape)} / {tuple(xs.shape)} do not "
                             f"match x {tuple(x2.shape)} in groups of {group} (ungrouped linears only)")
    if residual is not None and (groups > 1 or residual.shape != (*x.shape[:-1], w.shape[0])):
        raise ValueError(f"fp8_gemm: a residual must be [..., N] = {(*x.shape[:-1], w.shape[0])} of an ungrouped "
                         f"linear, got {tuple(residual.shape)}")
    add_to = None if residual is None else residual.view(-1, w.shape[0])
    out = _gemm(xq, xs, w, ws, block, group, x.dtype, invariant, split, tiles, groups, add_to)
    if residual is not None:
        return residual
    if groups > 1:
        return out.view(*x.shape[:-1], w.shape[0] // groups)
    return out.view(*x.shape[:-1], w.shape[0])
