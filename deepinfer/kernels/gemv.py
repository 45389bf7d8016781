"""Decode-sized linear layers, ``out = x @ W^T`` for at most 16 rows of x, streaming the
weight once; references: :func:`reference.gemv`, :func:`reference.grouped_gemv`.

At decode a projection multiplies M <= 16 token rows by a weight [N, K] of megabytes: the
cost is reading W from HBM (N*K*2 bytes in bf16), the arithmetic is negligible. cuBLAS
reaches about 70% of the H200's bandwidth at M=1; this kernel is shaped for the stream.

Tiling. Grid (N-tiles, K-splits, G). Program (j, s, g) owns output columns
[j*BLOCK_N, (j+1)*BLOCK_N) of group g, i.e. rows of g's weight, and walks its range of K in
BLOCK_K chunks: a [BLOCK_N, BLOCK_K] weight tile (each row a contiguous run: coalesced along
K) and the [BLOCK_M, BLOCK_K] slice of x. It accumulates the *transposed* output
[BLOCK_N, BLOCK_M] in float32, so the weight is the large operand. Two ways, a constexpr of
:class:`GemvConfig`:

- FMA (``use_dot`` False): ``acc[n, m, k] += w[n, k] * x[m, k]`` elementwise in float32,
  summed over k once after the loop (no cross-lane reduction per chunk). BLOCK_M is M
  rounded up to a power of two; for one or two rows, where a tensor-core tile is mostly padding.
- dot: ``acc = tl.dot(w, x^T, acc)`` with x padded to 16 rows (tl.dot's smallest tile); the
  weight tile is the A operand, its loads pipelined as a GEMM's (``num_stages``).

The weight's tail rows (N not a multiple of BLOCK_N) are read modulo N and never stored; a
K that is not a multiple of BLOCK_K is masked. x may have any row stride (a column slice of
a wider buffer); the grouped form reads x [M, G, Kg] with any row and group strides.

Split-K. When the N-tiles alone are too few to keep the SMs streaming (N = 1024 at BLOCK_N
64 is 16 programs), ``split_k`` programs share each N-tile, each reducing a contiguous run of
K (a multiple of BLOCK_K). They write float32 partials [S, G, M, N]; the last of a tile's
programs to arrive (an atomic counter per tile) sums the S partials in split order 0..S-1 and
writes the output. One launch, and the order of every sum is fixed by the shapes alone: the
result is bitwise reproducible whichever program finishes last. The counters live in one
zeroed int32 buffer per device that the finishing program resets, so a launch needs no
memset and replays under a CUDA graph; two launches must therefore not run concurrently on
different streams of a device, and the buffer is allocated on first use, which must not
happen during graph capture (warm-up forwards run eagerly first).

:func:`pick_config` reads the shapes only (not the device's SM count), so a given shape gives
the same bits on any GPU; nothing is read back from the device and every allocation is sized
by the shapes: CUDA-graph safe.

Numerics: float32 products and sums (``ieee`` tl.dot for float32 inputs), rounded once to x's
dtype; ``residual`` (gemv only) is added in float32 before that rounding, as
``torch.addmm(residual, x, W.t())`` does.

Shapes: M rows of x (tokens), K input width, N output width (per group), G groups,
S K-splits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16                # rows of x the kernel takes (one padded tl.dot tile)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MIN_DOT = 16                # tl.dot needs every tile side >= 16
# Programs a launch aims for: two per SM of an H200 (132 SMs). A constant rather than the
# device's SM count, so the split (and the result's bits) depend on the shapes alone.
_TARGET_PROGRAMS = 264
_MIN_SPLIT_COLS = 512        # columns of K per split at least: bounds the partials to reduce
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class GemvConfig:
    """Launch config: BLOCK_N weight rows x BLOCK_K columns per tile, ``split_k`` programs per
    N-tile along K (fewer where K has fewer BLOCK_K chunks: none is left empty), tl.dot (x
    padded to 16 rows) or elementwise FMA, warps and pipeline stages."""

    block_n: int
    block_k: int
    split_k: int
    use_dot: bool
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig: {name}={v} must be a power of two")
        if self.use_dot and min(self.block_n, self.block_k) < _MIN_DOT:
            raise ValueError(f"GemvConfig: use_dot needs block_n and block_k >= {_MIN_DOT}, got "
                             f"{self.block_n} and {self.block_k}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"GemvConfig: split_k={self.split_k} and num_stages={self.num_stages} must be >= 1")


def pick_config(m: int, n: int, k: int, groups: int = 1) -> GemvConfig:
    """The launcher's config for x [m, k] times weight [n, k] (per group, ``groups`` of them).

    FMA for one or two rows (BLOCK_M 1 or 2: the [BLOCK_N, BLOCK_M, BLOCK_K] float32
    accumulator stays at 64 registers a thread), tl.dot from three rows (a 16-row tile either
    way). Tiles of 16 KiB of bf16 weight per step (8 KiB at two rows). Split-K (:func:`split_for`) when the
    N-tiles of all groups are fewer than one per SM. Tiles never exceed the (power-of-two
    rounded) problem, so tiny test shapes stay tiny. Untuned: defaults to be set from the H200
    sweep (``scripts/gpu_kernel_check.py gemv``).
    """
    if m <= 2:
        use_dot, block_n, block_k, warps, stages = False, 32 // m, 256, 4, 2
    else:
        use_dot, block_n, block_k, warps, stages = True, 64, 128, 4, 4
    floor = _MIN_DOT if use_dot else 1
    block_n = min(block_n, max(floor, triton.next_power_of_2(n)))
    block_k = min(block_k, max(floor, triton.next_power_of_2(k)))
    return GemvConfig(block_n, block_k, split_for(groups * triton.cdiv(n, block_n), k), use_dot, warps, stages)


def split_for(tiles: int, k: int) -> int:
    """K-splits for ``tiles`` N-tiles (all groups) over K columns: none when the tiles fill
    half of ``_TARGET_PROGRAMS``, else about that many programs, each reducing at least
    ``_MIN_SPLIT_COLS`` columns."""
    if 2 * tiles >= _TARGET_PROGRAMS:
        return 1
    return max(1, min(triton.cdiv(_TARGET_PROGRAMS, tiles), k // _MIN_SPLIT_COLS))


@triton.jit
def _write(acc, out_ptr, res_ptr, g, rows, ms, mask, stride_om, stride_og, stride_rm, HAS_RES: tl.constexpr):
    """Store acc [BLOCK_N, BLOCK_M] (+ residual) as out[m, g, n], rounded once."""
    if HAS_RES:
        acc += tl.load(res_ptr + ms[None, :] * stride_rm + rows[:, None], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + g * stride_og + ms[None, :] * stride_om + rows[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, part_ptr, count_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_xg, stride_om, stride_og, stride_rm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, HAS_RES: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.program_id(2)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BN] output columns of group g
    ms = tl.arange(0, BLOCK_M)                                        # [BM] rows of x
    kk = tl.arange(0, BLOCK_K)
    mmask = ms < M
    # Tail rows re-read rows of the group (mod N) instead of masking the weight loads.
    w_row = (g * N + rows % N).to(tl.int64) * K                       # [BN]
    w_tile = w_ptr + w_row[:, None] + kk[None, :]                     # [BN, BK] at k = 0
    x_tile = x_ptr + g * stride_xg + ms[:, None] * stride_xm + kk[None, :]   # [BM, BK] at k = 0
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_tile + k0)                                              # [BN, BK]
            x = tl.load(x_tile + k0, mask=mmask[:, None], other=0.0)              # [BM, BK]
        else:
            kmask = k0 + kk < k_end
            w = tl.load(w_tile + k0, mask=kmask[None, :], other=0.0)
            x = tl.load(x_tile + k0, mask=mmask[:, None] & kmask[None, :], other=0.0)
        if USE_DOT:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc += w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]
    if USE_DOT:
        total = acc                                                   # [BN, BM]
    else:
        total = tl.sum(acc, axis=2)                                   # [BN, BM]

    out_mask = (rows < N)[:, None] & mmask[None, :]
    if SPLIT:
        n_tiles = tl.num_programs(0)
        n_splits = tl.num_programs(1)
        groups = tl.num_programs(2)
        part = part_ptr + (g * M + ms[None, :]) * N + rows[:, None]   # [BN, BM] in split 0's partial
        split_size = groups * M * N
        tl.store(part + split * split_size, total, mask=out_mask)
        # Publish: every thread's stores precede the barrier, the release atomic follows it.
        tl.debug_barrier()
        counter = count_ptr + g * n_tiles + tile
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == n_splits - 1:
            tl.store(counter, 0)                                      # ready for the next launch
            # Split order, not arrival order: the same bits whichever program is last. .cg reads
            # the other programs' partials from L2, where their stores landed.
            total = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
            for s in range(0, n_splits):
                total += tl.load(part + s * split_size, mask=out_mask, other=0.0, cache_modifier=".cg")
            _write(total, out_ptr, res_ptr, g, rows, ms, out_mask, stride_om, stride_og, stride_rm, HAS_RES)
    else:
        _write(total, out_ptr, res_ptr, g, rows, ms, out_mask, stride_om, stride_og, stride_rm, HAS_RES)


def fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
         grouped: bool = False) -> bool:
    """Whether the kernel takes these arguments: x [..., K] (its leading dims flattened to at
    most ``MAX_ROWS`` rows; ``grouped``: x [M, G, Kg], M <= MAX_ROWS) and weight [N, K] of
    one supported dtype, unit last strides (residual's too), a contiguous weight."""
    k = x.shape[-1]
    rows = x.shape[0] if grouped else x.numel() // max(k, 1)
    return (x.dtype in _DTYPES and rows <= MAX_ROWS and x.stride(-1) == 1
            and weight.dim() == 2 and weight.shape[1] == k and weight.dtype == x.dtype
            and weight.device == x.device and weight.is_contiguous()
            and (residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1)))


def _zeroed_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters, zero between launches (the kernel resets the ones it uses)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"gemv: the kernel's {n} split-K counters must be allocated before CUDA-graph "
                               "capture; run one eager forward with the same shapes first")
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _check_weight(who: str, x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"{who}: x must be float32/bfloat16/float16, got {x.dtype}")
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{who}: x has {x.shape[0]} rows; the kernel takes at most {MAX_ROWS} "
                         "(use F.linear for more)")
    if x.stride(-1) != 1 and k > 1:
        raise ValueError(f"{who}: x must have a unit last stride, got strides {x.stride()}")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"{who}: weight must be [N, {k}] (x's last dim), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"{who}: weight ({weight.dtype}, {weight.device}) must match x ({x.dtype}, {x.device})")
    if not weight.is_contiguous():
        raise ValueError(f"{who}: weight must be contiguous, got strides {weight.stride()}")


def _check_rows(who: str, name: str, t: torch.Tensor | None, shape: tuple[int, ...], x: torch.Tensor) -> None:
    """``t`` (out or residual) must be [M, N] like the result, in x's dtype, unit column stride."""
    if t is None:
        return
    if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
        raise ValueError(f"{who}: {name} must be {x.dtype} {list(shape)} on {x.device}, got {t.dtype} "
                         f"{list(t.shape)} on {t.device}")
    if t.stride(-1) != 1 and shape[-1] > 1:
        raise ValueError(f"{who}: {name} must have a unit last stride, got strides {t.stride()}")


def _launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None,
            groups: int, config: GemvConfig | None) -> None:
    """x [M, G, K] (strided), weight [G*N, K] -> out [M, G, N] (strided), residual [M, N] (G = 1)."""
    m, _, k = x.shape
    n = out.shape[2]
    if out.numel() == 0:
        return
    if k == 0:
        out.copy_(residual.view_as(out) if residual is not None else torch.zeros_like(out))
        return
    cfg = config or pick_config(m, n, k, groups)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(k, k_per_split)                 # none empty
    n_tiles = triton.cdiv(n, cfg.block_n)
    dev = x.device
    if splits > 1:
        part = torch.empty(splits, groups, m, n, dtype=torch.float32, device=dev)   # [S, G, M, N]
        counters = _zeroed_counters(dev, groups * n_tiles)
    else:
        part = counters = out                                                     # unused
    res = residual if residual is not None else out
    _gemv_kernel[(n_tiles, splits, groups)](
        x, weight, out, res, part, counters,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1), res.stride(0),
        BLOCK_M=max(_MIN_DOT if cfg.use_dot else 1, triton.next_power_of_2(m)),
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot, EVEN_K=k % cfg.block_k == 0,
        SPLIT=splits > 1, HAS_RES=residual is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
         residual: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """``x @ weight.T (+ residual)``: x [M, K] (M <= 16, any row stride, unit column stride),
    weight [N, K] contiguous, same dtype -> [M, N] in x's dtype (written into ``out`` if given;
    ``residual`` [M, N] is added before rounding). ``config`` overrides :func:`pick_config`."""
    if x.dim() != 2:
        raise ValueError(f"gemv: x must be [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    _check_weight("gemv", x, weight, k)
    n = weight.shape[0]
    _check_rows("gemv", "out", out, (m, n), x)
    _check_rows("gemv", "residual", residual, (m, n), x)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)                   # [M, N]
    _launch(x[:, None], weight, out[:, None], residual, 1, config)
    return out


def grouped_gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None) -> torch.Tensor:
    """Block-diagonal projection: x [M, G, Kg] (M <= 16, unit last stride), weight [G*Ng, Kg]
    contiguous (the G groups' [Ng, Kg] matrices stacked on rows) -> [M, G, Ng] with
    ``out[:, g] = x[:, g] @ W_g^T``. ``config`` overrides :func:`pick_config`."""
    if x.dim() != 3:
        raise ValueError(f"grouped_gemv: x must be [M, G, Kg], got shape {tuple(x.shape)}")
    m, groups, k = x.shape
    _check_weight("grouped_gemv", x, weight, k)
    if groups == 0 or weight.shape[0] % groups:
        raise ValueError(f"grouped_gemv: weight rows {weight.shape[0]} must split into x's {groups} groups")
    n = weight.shape[0] // groups
    out = torch.empty(m, groups, n, dtype=x.dtype, device=x.device)               # [M, G, Ng]
    _launch(x, weight, out, None, groups, config)
    return out
