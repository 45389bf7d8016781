"""Batch-invariant Triton kernels for the aten ops the CUDA batch-invariant mode replaces
(``batch_invariant.py``): a batched matmul and row reductions (softmax, log-softmax,
logsumexp, sum, mean). References: torch's own ops.

Contract: an output row's bits depend only on that row's inputs (and, for the matmul, the
other operand), never on how many rows share the call. Each kernel's config is chosen from
dtypes and, for the matmul, the second operand's shape (N, K) alone, never from M:

* matmul (:class:`MatmulConfig`, :func:`matmul_config`): BLOCK_M x BLOCK_N output tiles, float32
  accumulation by ``tl.dot``, the K reduction in BLOCK_K steps in order. BLOCK_M is fixed by the
  config, so the MMA's shape does not follow M either, and rows of a tile are computed
  independently by the MMA: a row's result does not depend on its neighbours or its place in the
  tile. ``mm`` runs as a batch of one, so a product that is an mm for one sequence and a bmm for
  several gives the same bits.
* split K: when the output tiles of one row block (N / BLOCK_N of them) leave SMs idle, as a
  decode step's weight-streaming projections do, K is cut into S slices of whole K steps
  (:func:`matmul_split`: S from N, K, the config and the SM count, never M). Each slice stores a
  float32 partial; the tile's last slice to finish (an int32 counter per tile, taken with an
  acquire-release atomic and put back to zero, so CUDA-graph replays find it zeroed) adds the S
  partials in slice order 0, 1, ... and writes the output, as ``fp8_gemm`` does. The order is
  fixed, so the bits do not depend on which program finishes last (no float atomics) or on M.
  The second operand is a weight in every product the mode sees on CUDA (attention runs in its
  own kernels), so its (N, K) never follows the batch; a product whose K did (zero-padded to
  the batch's longest) would need ``max_split=1``, whose steps start at absolute offsets.
* TMA (``MatmulConfig.tma``): for one product (a batch of one) whose activations and weight
  rows are K-contiguous and 16-byte aligned, the tiles come by TMA descriptors instead of
  pointer loads (zeros beyond the edges, as the masked loads' ``other``): the same values into
  the same MMAs, so the same bits; other operands take the pointer loads.
* large M (``MatmulConfig.large``, from ``large_min_m`` rows): a prefill has tiles enough to fill
  the SMs, so the partials' round trip through memory only costs; it takes bigger output tiles
  (:class:`MatmulTile`) and each program walks the same S slices in order itself, starting each
  slice's sum from zero and adding the slices' sums in slice order: the float32 operations of the
  split launch, in the same order, so the bits are the same. The K steps (BLOCK_K) are shared, and
  the tile's shape only sets how many rows and columns one MMA instruction covers: each output's
  dot product over a K step is the same instruction's (Hopper's warpgroup MMA needs 64-row tiles
  and warps in fours, which ``MatmulConfig`` checks), so a row's bits do not follow the tile.
* row reductions: one program per row, which walks its row in BLOCK-wide chunks; each lane
  keeps a running float32 partial (for the softmaxes a running max and a rescaled sum) and
  the lanes meet in one ``tl.sum`` at the end. An element's lane is its column modulo BLOCK,
  so a row padded at its end (exact zeros for sums, -inf for softmaxes) keeps every real
  element's lane and the padding adds nothing: the bits do not depend on the padded width
  either. Reductions over other dims run as rows after a permute (the stock CUDA reduction
  splits a long reduction over several CTAs when there are few outputs, so its order
  depends on the output count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer.kernels import pdl
from deepinfer.kernels.launch import sm_count, tile_counters


@dataclass(frozen=True)
class MatmulTile:
    """The output tile of the large-M launch: rows, columns, warps and pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def label(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class MatmulConfig:
    """The invariant matmul's launch: tile shape, warps, pipeline stages and the most K slices."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    max_split: int = 1          # S <= max_split (a power of two); 1: never split K
    waves: int = 1              # S also keeps one row block's tiles x S within waves x the SM count
    large: MatmulTile | None = None   # the tile from ``large_min_m`` rows on (the slices run in order)
    large_min_m: int = 256
    tma: bool = False           # tiles by TMA descriptors where the operands allow (see ``bmm``)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"MatmulConfig: {name}={v} must be a power of two >= 16 (the MMA's minimum)")
        if self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"MatmulConfig: num_warps={self.num_warps} must be 1, 2, 4, 8 or 16 and "
                             f"num_stages={self.num_stages} >= 1")
        if self.max_split < 1 or self.max_split & (self.max_split - 1):
            raise ValueError(f"MatmulConfig: max_split={self.max_split} must be a power of two >= 1")
        if self.waves < 1:
            raise ValueError(f"MatmulConfig: waves={self.waves} must be >= 1")
        if self.large is not None:
            tiles = ((self.block_m, self.block_n, self.num_warps),
                     (self.large.block_m, self.large.block_n, self.large.num_warps))
            for bm, bn, warps in tiles:
                # Both launches must multiply a K step with the same MMA instruction (module docstring).
                if bm < 64 or bm & (bm - 1) or bn < 16 or bn & (bn - 1) or warps % 4:
                    raise ValueError(f"MatmulConfig: a config with a large-M tile needs 64-row or larger "
                                     f"power-of-two tiles and warps in fours (one MMA instruction for "
                                     f"both launches), got {bm}x{bn} with {warps} warps")
            if self.large.num_stages < 1 or self.large_min_m < 1:
                raise ValueError(f"MatmulConfig: large.num_stages={self.large.num_stages} and "
                                 f"large_min_m={self.large_min_m} must be >= 1")

    @property
    def label(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} "
                f"S<={self.max_split}" + (f" waves {self.waves}" if self.waves > 1 else "")
                + (f" M>={self.large_min_m}: {self.large.label}" if self.large else "")
                + (" tma" if self.tma else ""))


# The first config: 64 x 64 tiles, 32-deep K steps, no split: at V4-Flash widths on an H100 the
# mode cost 2.36x the normal decode at one token (64 programs for N = 4,096 on 132 SMs, 4 KB a
# pipeline stage) and 2.83x at a 4,096-token prefill.
LEGACY_MATMUL = MatmulConfig(64, 64, 32, 4, 3, max_split=1)
# A split candidate: 64 x 128 tiles, 64-deep K steps, 4 warps, 4 stages, up to eight K slices.
SPLIT_MATMUL = MatmulConfig(64, 128, 64, 4, 4, max_split=8)
# Candidate, float32 inputs (exact, non-TF32 products on CUDA cores, as torch's default float32
# matmul): the 16-bit tiles at half the K depth, so the stages take the same shared memory.
SPLIT_MATMUL_F32 = MatmulConfig(64, 128, 32, 4, 4, max_split=8)
# The 16-bit default: 64-row tiles (cheap enough to stay weight-bound at one token), 128 columns,
# 64-deep K steps, 8 warps, 3 stages and up to eight K slices, so a decode projection's N / 128
# tiles still cover the SMs; from 256 rows 128 x 256 tiles walking the same slices. On an H100 at
# the V4-Flash projections and lm_head (scripts/probes/batch_invariant_configs.py, specialised
# strides): 1.00 / 0.99 / 1.03 / 1.37x cuBLAS at M = 1 / 16 / 64 / 4,096 (128 x 128 large tiles:
# 1.43x at 4,096).
DEFAULT_MATMUL = MatmulConfig(64, 128, 64, 8, 3, max_split=8, large=MatmulTile(128, 256, 8, 3))
DEFAULT_MATMUL_F32 = LEGACY_MATMUL
MATMUL_CONFIG: MatmulConfig | None = None
"""Overrides :func:`matmul_config` for every product (benchmarks sweep it); None: the defaults."""
GROUP_M = 8
"""Row blocks per group in the matmul's program order (L2 reuse of the weight tiles)."""
MIN_SLICE_STEPS = 4
"""Each K slice is at least this many BLOCK_K steps: shorter slices spend more on partials than
they gain in parallel weight streams."""
# Columns a row-reduction program reads per step (4 warps, 8 float32 a thread).
ROW_BLOCK = 1024
ROW_WARPS = 4

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def matmul_config(n: int, k: int, dtype: torch.dtype) -> MatmulConfig:
    """The launch config of a product with a [K, N] second operand in ``dtype``; never depends on
    M, so every row of every call with that operand shares it. (n, k) are the hook for a config
    by weight shape; today one config serves every shape of a dtype."""
    if MATMUL_CONFIG is not None:
        return MATMUL_CONFIG
    return DEFAULT_MATMUL_F32 if dtype == torch.float32 else DEFAULT_MATMUL


def matmul_split(cfg: MatmulConfig, n: int, k: int, sms: int) -> int:
    """K slices S: the largest power of two <= ``cfg.max_split`` with N / BLOCK_N tiles times S
    within ``cfg.waves`` x ``sms`` programs and every slice at least :data:`MIN_SLICE_STEPS` K steps;
    1 when one row block's tiles alone fill the SMs. From (N, K) and the device alone, never M."""
    tiles, steps = triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k)
    s = 1
    while 2 * s <= cfg.max_split and tiles * 2 * s <= cfg.waves * sms and steps >= 2 * s * MIN_SLICE_STEPS:
        s *= 2
    return s


def matmul_launch(cfg: MatmulConfig, m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, S, split launch) of an [M, K] x [K, N] product:
    the config's tile with its S slices one program each, or from ``large_min_m`` rows its large
    tile walking the same S slices in order (see the module docstring)."""
    split = matmul_split(cfg, n, k, sms)
    if cfg.large is not None and m >= cfg.large_min_m:
        t = cfg.large
        return t.block_m, t.block_n, t.num_warps, t.num_stages, split, False
    return cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, split, split > 1


# M is not specialised (one kernel for every M). The strides are: Triton proves 16-byte alignment
# from their divisibility, and without it every row's loads would be element by element, with no
# asynchronous copies to pipeline (it changes how the tiles are loaded, never the arithmetic).
@triton.jit(do_not_specialize=["M"])
def _bmm_kernel(a_ptr, b_ptr, c_ptr, part_ptr, count_ptr, M, N, K, slice_steps, split,
                stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn,
                stride_cb, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, GROUP_M: tl.constexpr, TMA: tl.constexpr,
                DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    # Tiles in groups of GROUP_M row blocks, column-major inside a group, so programs running
    # together share their weight tiles in L2 (which program computes a tile never changes its sums).
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                              # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                              # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    if not TMA:
        a_rows = a_ptr + batch * stride_ab + rows.to(tl.int64)[:, None] * stride_am
        b_cols = b_ptr + batch * stride_bb + cols.to(tl.int64)[None, :] * stride_bn
    # Slice s is ``slice_steps`` K steps from step ``s * slice_steps`` on. A split launch's program
    # takes one slice; otherwise the program takes them all in order, each summed from zero and
    # added to the running total, the same float32 operations the split launch's last program does.
    if SPLIT_K:
        first = tl.program_id(2)
        last = first + 1
    else:
        first = 0
        last = split
    total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(first, last):
        k_begin = s * slice_steps * BLOCK_K
        k_end = tl.minimum(K, k_begin + slice_steps * BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if TMA:
            # a_ptr: a descriptor over A [M, K]; b_ptr: one over the weight [N, K] (B's transpose).
            # Out-of-range rows and K columns arrive as zeros, as the masked loads' ``other``.
            for k0 in range(k_begin, k_end, BLOCK_K):
                a = a_ptr.load([pid_m * BLOCK_M, k0])                             # [BLOCK_M, BLOCK_K]
                b = b_ptr.load([pid_n * BLOCK_N, k0]).T                           # [BLOCK_K, BLOCK_N]
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        else:
            a_ptrs = a_rows + (k_begin + ks)[None, :] * stride_ak              # [BLOCK_M, BLOCK_K]
            b_ptrs = b_cols + (k_begin + ks)[:, None] * stride_bk              # [BLOCK_K, BLOCK_N]
            for k0 in range(k_begin, k_end, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=row_ok, other=0.0)
                    b = tl.load(b_ptrs, mask=col_ok, other=0.0)
                else:
                    k_ok = k0 + ks < K
                    a = tl.load(a_ptrs, mask=row_ok & k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok, other=0.0)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
        total = tl.where(s == first, acc, total + acc)     # the first slice's sum as it is (no 0 + x)
    acc = total
    out_mask = row_ok & col_ok
    c = c_ptr + batch * stride_cb + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    if SPLIT_K:
        # Partials [S, B, M, N] float32; the tile's last slice to finish adds them in slice order
        # 0, 1, ... (the same sums whichever program is last) and zeroes the tile's counter again
        # for the next launch or CUDA-graph replay.
        per_slice = tl.num_programs(1).to(tl.int64) * M * N
        offs = (batch * M + rows.to(tl.int64)[:, None]) * N + cols[None, :]
        tl.store(part_ptr + tl.program_id(2) * per_slice + offs, acc, mask=out_mask)
        tl.debug_barrier()                       # every thread's partial is written before the count
        tile = batch * tl.num_programs(0) + pid
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == split - 1:
            total = tl.load(part_ptr + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            for s in range(1, split):
                total += tl.load(part_ptr + s * per_slice + offs, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(c, total.to(c_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=out_mask)


def _tma_ready(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether A [M, K] and the weight W [N, K] (B's transpose) can be read by TMA descriptors:
    unit stride along K, 16-byte aligned rows and start."""
    return all(t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (a, w))


def bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None,
        config: MatmulConfig | None = None) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N] in ``out_dtype`` (default: the inputs' dtype),
    accumulated in float32 (any strides). ``config`` overrides :func:`matmul_config`."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"batch-invariant bmm: shapes {tuple(a.shape)} and {tuple(b.shape)} must be "
                         "[B, M, K] and [B, K, N]")
    if a.dtype != b.dtype or a.dtype not in _DTYPES:
        raise ValueError(f"batch-invariant bmm: both operands must share a dtype of {_DTYPES}, got "
                         f"{a.dtype} and {b.dtype}")
    batch, m, k = a.shape
    n = b.shape[2]
    out = torch.empty((batch, m, n), dtype=out_dtype or a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config or matmul_config(n, k, a.dtype)
    block_m, block_n, warps, stages, split, split_launch = matmul_launch(cfg, m, n, k, sm_count(a.device))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    if split_launch:
        part = torch.empty((split, batch, m, n), dtype=torch.float32, device=a.device)
        counts = tile_counters(a.device, batch * tiles)
    else:
        part = counts = out
    # One entry's batch strides never matter: zero, so that they do not follow M (M x K is the
    # stride of a contiguous [1, M, K]) and prove nothing false about alignment.
    one = batch == 1
    tma = cfg.tma and one and _tma_ready(a[0], b[0].t())
    a_arg, b_arg = a, b
    if tma:
        a_arg = TensorDescriptor(a[0], [m, k], [a.stride(1), 1], [block_m, cfg.block_k])
        b_arg = TensorDescriptor(b[0].t(), [n, k], [b.stride(2), 1], [block_n, cfg.block_k])
    _bmm_kernel[(tiles, batch, split if split_launch else 1)](
        a_arg, b_arg, out, part, counts, m, n, k, triton.cdiv(triton.cdiv(k, cfg.block_k), split), split,
        0 if one else a.stride(0), a.stride(1), a.stride(2), 0 if one else b.stride(0), b.stride(1), b.stride(2),
        0 if one else out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, SPLIT_K=split_launch,
        EVEN_K=k % cfg.block_k == 0, GROUP_M=GROUP_M, TMA=tma,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages, **pdl.flags(out.device))
    return out


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None,
       config: MatmulConfig | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N], as a batch of one (see the module docstring)."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"batch-invariant mm: shapes {tuple(a.shape)} and {tuple(b.shape)} must be 2-D")
    return bmm(a[None], b[None], out_dtype, config)[0]


# Row-reduction ops (constexpr OP of _row_reduce_kernel).
SUM, MEAN, LOGSUMEXP, SOFTMAX, LOG_SOFTMAX = 0, 1, 2, 3, 4


@triton.jit(do_not_specialize=["stride_x", "stride_out"])
def _row_reduce_kernel(x_ptr, out_ptr, n, stride_x, stride_out,
                       OP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    if OP == 0 or OP == 1:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for n0 in range(0, n, BLOCK):
            acc += tl.load(x_row + n0 + cols, mask=n0 + cols < n, other=0.0).to(tl.float32)
        total = tl.sum(acc, axis=0)
        if OP == 1:
            total = total / n
        tl.store(out_row, total.to(out_ptr.dtype.element_ty))
    else:
        # Per lane: the running max of its elements and their sum of exp(x - max).
        m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        s = tl.zeros([BLOCK], dtype=tl.float32)
        for n0 in range(0, n, BLOCK):
            x = tl.load(x_row + n0 + cols, mask=n0 + cols < n, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # A lane that has seen only -inf keeps max -inf: shift by 0, not by -inf (nan).
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - shift) + tl.exp(x - shift)
            m = m_new
        row_max = tl.max(m, axis=0)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        total = tl.sum(s * tl.exp(m - shift), axis=0)
        if OP == 2:
            tl.store(out_row, (row_max + tl.log(total)).to(out_ptr.dtype.element_ty))
        else:
            log_total = tl.log(total)
            for n0 in range(0, n, BLOCK):
                mask = n0 + cols < n
                x = tl.load(x_row + n0 + cols, mask=mask, other=float("-inf")).to(tl.float32)
                if OP == 3:
                    y = tl.exp(x - shift) / total
                else:
                    y = x - shift - log_total
                tl.store(out_row + n0 + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_of(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """x with ``dims`` moved last and flattened: [rows, prod(dims sizes)], last dim contiguous."""
    keep = [d for d in range(x.dim()) if d not in dims]
    width = 1
    for d in dims:
        width *= x.shape[d]
    rows = x.permute(*keep, *dims).reshape(-1, width)
    return rows if rows.stride(-1) == 1 or width <= 1 else rows.contiguous()


def _launch_rows(rows: torch.Tensor, out: torch.Tensor, op: int) -> None:
    if rows.shape[0] == 0:
        return
    _row_reduce_kernel[(rows.shape[0],)](rows, out, rows.shape[1], rows.stride(0), out.stride(0),
                                         OP=op, BLOCK=ROW_BLOCK, num_warps=ROW_WARPS, **pdl.flags(out.device))


def _dims(x: torch.Tensor, dim: int | list[int] | tuple[int, ...] | None) -> list[int]:
    """The reduced dims, normalised and sorted (None or empty: all of them)."""
    if dim is None or (not isinstance(dim, int) and len(dim) == 0):
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % x.dim() for d in dims})


def reduce(x: torch.Tensor, dim: int | list[int] | None, keepdim: bool, op: int,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    """``op`` (SUM, MEAN or LOGSUMEXP) of floating x over ``dim`` (None: all dims), float32
    accumulation, the result in ``dtype`` (default x's dtype)."""
    if op not in (SUM, MEAN, LOGSUMEXP):
        raise ValueError(f"batch-invariant reduce: op={op} must be SUM, MEAN or LOGSUMEXP")
    if x.dtype not in _DTYPES or (dtype is not None and dtype not in _DTYPES):
        raise ValueError(f"batch-invariant reduce: x is {x.dtype} (dtype={dtype}); takes {_DTYPES}")
    dims = _dims(x, dim)
    kept_shape = [1 if d in dims else s for d, s in enumerate(x.shape)]
    rows = _rows_of(x, dims)
    out = torch.empty(rows.shape[0], dtype=dtype or x.dtype, device=x.device)
    if rows.shape[1] == 0 and rows.shape[0] > 0:
        # An empty reduction: the sum is 0, the mean nan, the logsumexp -inf (as torch).
        return out.fill_({SUM: 0.0, MEAN: float("nan"), LOGSUMEXP: float("-inf")}[op]).reshape(
            kept_shape if keepdim else [s for d, s in enumerate(x.shape) if d not in dims])
    _launch_rows(rows, out, op)
    out = out.reshape(kept_shape)
    return out if keepdim else out.reshape([s for d, s in enumerate(x.shape) if d not in dims])


def softmax(x: torch.Tensor, dim: int, log: bool, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(log-)softmax of floating x over ``dim``, in float32, the result in ``out_dtype``
    (default x's dtype), contiguous in x's shape."""
    if x.dtype not in _DTYPES:
        raise ValueError(f"batch-invariant softmax: x is {x.dtype}; takes {_DTYPES}")
    if x.dim() == 0:
        x = x.reshape(1)
        return softmax(x, 0, log, out_dtype).reshape(())
    dim = dim % x.dim()
    moved = x.movedim(dim, -1)
    rows = _rows_of(moved, [moved.dim() - 1])
    out = torch.empty(rows.shape, dtype=out_dtype or x.dtype, device=x.device)
    if rows.shape[1] > 0:
        _launch_rows(rows, out, LOG_SOFTMAX if log else SOFTMAX)
    return out.reshape(moved.shape).movedim(-1, dim).contiguous()
