"""DeepSeek-V4 hyper-connection mixing (mHC) as Triton kernels; references:
:func:`reference.hc_pre`, :func:`reference.hc_post`, :func:`reference.hc_head`.

Shapes: T tokens, n streams (``hc_mult``, 4 in V4), D hidden size, K = n*D the
flattened streams, M mixing rows ((2+n)*n = 24 for a layer's connection, n for
the head).

**pre** (and the head). The projection ``rms(s) @ fn.T`` is [T, K] x [K, M]
with M tiny, so its cost is reading the streams (T*K*2 bytes in bf16) and, at
small T, reading ``fn`` (M*K*4 bytes, 1.5 MiB at V4-Flash widths). Programs tile
(split of K) x (block of tokens): each reads its stream tile once, accumulating
the dot products with ``fn`` and the sum of squares (float32), and writes them as
a partial. The dot products, by block size:

- under 16 tokens (decode): float32 FMAs, not a tensor-core tile padded to 16 rows;
- up to 256 tokens, and float32 streams: ``tl.dot`` on the float32 tile with
  tf32x3 (about float32 accuracy; it splits both operands into tf32 hi/lo parts in
  registers every K step);
- more tokens, bf16 streams (prefill): the tile as loaded against ``fn`` split into
  three bf16 parts (``HCConfig.bf16_split``; ``split_dot.dot_bf16x3``), three bf16
  ``tl.dot`` into one float32 accumulator: as accurate as tf32x3, while the bf16 tile needs
  no conversion or splitting: tf32x3's per-element ALU work kept the kernel at ~188 us at
  T=4096 against ~32 us of stream bytes (H200).

The last program of a token block to arrive (an atomic counter per block) sums the
partials, applies the RMS factor (``rms(s) @ fn.T == rsqrt(mean(s^2)+eps) *
(s @ fn.T)``), the sigmoids, the softmax and the Sinkhorn-Knopp iterations in
float32 and writes post/comb. Then the collapse ``x = sum_j pre_j s_j``:

- one token (``HCConfig.one_launch_max_t``): the same finishing program
  collapses it, one load wave over the 4 x D stream values its sibling programs
  have just brought into L2. One launch in all.
- more tokens: the finishing program writes ``pre`` and a second launch
  collapses over a (token, D tile) grid: a finishing program collapsing 16
  tokens alone takes longer than the extra launch (measured on the H200; see
  :func:`pick_config`). The streams are then read twice (the second time from
  L2 while they fit there: T <= ~1500 in bf16).

With the block's input RMSNorm (``norm``: DeepSeek-V4 normalises the block input and
nothing else reads it) the collapse launch normalises too, so x is never written and
read back, and the norm needs no launch of its own: a program then holds a token's whole row (the
sum of squares needs it), with :func:`rms_norm.row_config`'s width and warps and
:func:`rms_norm.inv_rms`'s reduction, on x rounded to the streams' dtype as the norm
kernel would load it, so the result equals ``rms_norm(x)`` bit for bit. A single
token then takes this launch too rather than the one-launch collapse (whose program
runs the projection's warp count: another reduction tree), still two launches as the
collapse and the norm were.

Small T spreads K over many programs (at least 256 columns each) so that
``fn`` is read in parallel; large T uses bigger token blocks so ``fn`` is
re-read less from L2 (32 x 1.5 MiB at T=4096).

The counters live in the launchers' zeroed int32 set of the current stream
(``launch.tile_counters``, shared with the split-K GEMMs) that the finishing
program resets, so a launch needs no memset and replays under a CUDA graph;
launches on one stream run one after another. A CUDA-graph capture stream gets
its own set, allocated and zeroed within the first capture.

**post** is one elementwise launch: for each token and D tile,
``out_k = post_k * block_out + sum_j comb[j, k] * s_j`` in float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.fp8_gemm import check_quant_group, store_quant_groups
from deepinfer.kernels.launch import sm_count, tile_counters
from deepinfer.kernels.rms_norm import MAX_COLS, inv_rms, row_config
from deepinfer.kernels.split_dot import dot_bf16x3

_MIN_DOT = 16              # tl.dot needs every tile side >= 16
_ONE_LAUNCH_MAX_T = 1      # up to here the finishing program also collapses (one launch)
_MIN_SPLIT_COLS = 256      # columns of K per program at least: caps the partials to reduce


@triton.jit
def _hc_pre_kernel(
    s_ptr, fn_ptr, base_ptr, scale_ptr,
    part_ptr, count_ptr,
    x_ptr, pre_ptr, post_ptr, comb_ptr,
    T, D, s_stride, x_stride,
    cols_per_split, n_splits, sinkhorn_iters,
    hc_eps, norm_eps,
    N: tl.constexpr, NP: tl.constexpr, NMIX: tl.constexpr, NCOL: tl.constexpr,
    FULL: tl.constexpr, COLLAPSE: tl.constexpr, PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
    BF16_SPLIT: tl.constexpr, BF16_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    COPIES: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    split = tl.program_id(0)
    tb = tl.program_id(1)
    K = N * D
    toks = (tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)         # [BT]
    tmask = toks < T
    cols = tl.arange(0, NCOL)
    kk = tl.arange(0, BLOCK_K)

    # Partial projection over this program's columns of K.
    acc = tl.zeros([BLOCK_T, NCOL], tl.float32)                       # [BT, NCOL] s @ fn.T
    sq = tl.zeros([BLOCK_T], tl.float32)                              # [BT] sum of s^2
    k_begin = split * cols_per_split
    for k0 in range(0, cols_per_split, BLOCK_K):
        ks = k_begin + k0 + kk                                        # [BK]
        kmask = ks < K
        if COPIES:                                                    # n copies of one [T, D] row
            cs = tl.multiple_of((k_begin + k0) % D, BLOCK_K) + kk     # BLOCK_K divides D
        else:
            cs = ks
        x = tl.load(s_ptr + toks[:, None] * s_stride + cs[None, :],
                    mask=tmask[:, None] & kmask[None, :], other=0.0)  # [BT, BK] streams' dtype
        xf = x.to(tl.float32)
        w_ptrs = fn_ptr + cols[None, :] * K + ks[:, None]             # [BK, NCOL]
        wmask = kmask[:, None] & (cols[None, :] < NMIX)
        if BF16_SPLIT:                                                # bf16 x times fn's three bf16 parts
            acc = dot_bf16x3(x, tl.load(w_ptrs, mask=wmask, other=0.0), acc, BF16_DOT)
        else:
            w = tl.load(w_ptrs, mask=wmask, other=0.0)
            if USE_DOT:
                acc = tl.dot(xf, w, acc, input_precision=PRECISION)
            else:                                                     # few tokens: float32 FMAs
                acc += tl.sum(xf[:, :, None] * w[None, :, :], axis=1)
        sq += tl.sum(xf * xf, axis=1)
    acc = tl.where(cols[None, :] == NMIX, sq[:, None], acc)
    rows = part_ptr + toks[:, None] * NCOL + cols[None, :]            # [BT, NCOL] split 0's rows
    tl.store(rows + split * T * NCOL, acc, mask=tmask[:, None])

    # Publish: every thread's stores precede the barrier, the release atomic follows it.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tb, 1, sem="acq_rel", scope="gpu")
    if arrived == n_splits - 1:
        tl.store(count_ptr + tb, 0)                                   # ready for the next launch
        # Sum the partials, BLOCK_S splits per load; .cg reads them from L2, where the other
        # programs' stores landed. The totals go back to split 0's rows (only this program
        # reads them) to be reloaded in the shapes the mixing needs.
        ss = tl.arange(0, BLOCK_S)
        tot = tl.zeros([BLOCK_T, NCOL], tl.float32)
        for s0 in range(0, n_splits, BLOCK_S):
            sm = (s0 + ss) < n_splits
            tile = tl.load(rows[None, :, :] + (s0 + ss)[:, None, None] * (T * NCOL),
                           mask=sm[:, None, None] & tmask[None, :, None], other=0.0, cache_modifier=".cg")
            tot += tl.sum(tile, axis=0)
        tl.store(rows, tot, mask=tmask[:, None])
        tl.debug_barrier()
        j = tl.arange(0, NP)
        jmask = j < N
        m2 = tmask[:, None] & jmask[None, :]
        row0 = part_ptr + toks * NCOL                                 # [BT] pointers to the totals
        sq = tl.load(row0 + NMIX, mask=tmask, other=0.0, cache_modifier=".cg")
        rs = tl.rsqrt(sq / K + norm_eps)                              # [BT] RMS factor
        pre_raw = tl.load(row0[:, None] + j[None, :], mask=m2, other=0.0, cache_modifier=".cg")
        pre_b = tl.load(base_ptr + j, mask=jmask, other=0.0)
        pre = tl.sigmoid(pre_raw * rs[:, None] * tl.load(scale_ptr) + pre_b[None, :]) + hc_eps
        pre = tl.where(jmask[None, :], pre, 0.0)                      # [BT, NP]

        if FULL:
            post_raw = tl.load(row0[:, None] + N + j[None, :], mask=m2, other=0.0, cache_modifier=".cg")
            post_b = tl.load(base_ptr + N + j, mask=jmask, other=0.0)
            post = 2 * tl.sigmoid(post_raw * rs[:, None] * tl.load(scale_ptr + 1) + post_b[None, :])
            tl.store(post_ptr + toks[:, None] * N + j[None, :], post, mask=m2)
            valid = jmask[:, None] & jmask[None, :]                   # [NP, NP]
            m3 = tmask[:, None, None] & valid[None, :, :]
            comb_raw = tl.load(row0[:, None, None] + 2 * N + j[None, :, None] * N + j[None, None, :],
                               mask=m3, other=0.0, cache_modifier=".cg")             # [BT, i, j]
            comb_b = tl.load(base_ptr + 2 * N + j[:, None] * N + j[None, :], mask=valid, other=0.0)
            logits = comb_raw * rs[:, None, None] * tl.load(scale_ptr + 2) + comb_b[None, :, :]
            # Padding rows/columns (n not a power of two) get a finite filler, then weight 0
            # (a padding row keeps a nonzero softmax denominator).
            logits = tl.where(valid[None, :, :], logits, -1e30)
            e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
            e = tl.where(jmask[None, None, :], e, 0.0)
            comb = tl.where(valid[None, :, :], e / tl.sum(e, axis=2)[:, :, None] + hc_eps, 0.0)
            # Sinkhorn-Knopp: columns first, then (rows, columns) until iters normalisations.
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
            for _ in range(sinkhorn_iters - 1):
                comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
                comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
            tl.store(comb_ptr + toks[:, None, None] * (N * N) + j[None, :, None] * N + j[None, None, :],
                     comb, mask=m3)

        if COLLAPSE:
            # x = sum_j pre_j * s_j, token by token over full-width D tiles (a decode block has
            # few tokens: one load wave per token), summed in stream order as the reference.
            rows_t = tl.arange(0, BLOCK_T)
            for tt in range(0, tl.minimum(BLOCK_T, T - tb * BLOCK_T)):
                tok = (tb * BLOCK_T + tt).to(tl.int64)
                pt = tl.sum(tl.where(rows_t[:, None] == tt, pre, 0.0), axis=0)          # [NP]
                for d0 in range(0, D, BLOCK_D):
                    ds = d0 + tl.arange(0, BLOCK_D)
                    dmask = ds < D
                    xo = tl.zeros([BLOCK_D], tl.float32)
                    for jj in tl.static_range(N):
                        pj = tl.sum(tl.where(j == jj, pt, 0.0), axis=0)
                        sv = tl.load(s_ptr + tok * s_stride + (0 if COPIES else jj * D) + ds, mask=dmask,
                                     other=0.0)
                        xo += pj * sv.to(tl.float32)
                    tl.store(x_ptr + tok * x_stride + ds, xo.to(x_ptr.dtype.element_ty), mask=dmask)
        else:
            tl.store(pre_ptr + toks[:, None] * N + j[None, :], pre, mask=m2)


@triton.jit
def _hc_collapse_kernel(
    s_ptr, pre_ptr, w_ptr, x_ptr, q_ptr, qs_ptr, D, s_stride, x_stride, eps,
    N: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, COPIES: tl.constexpr = False,
    QUANT_GROUP: tl.constexpr = 0, POW2: tl.constexpr = False, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)          # [BD]
    dmask = ds < D
    xo = tl.zeros([BLOCK_D], tl.float32)
    for j in tl.static_range(N):                                      # stream order, as the reference
        sv = tl.load(s_ptr + t * s_stride + (0 if COPIES else j * D) + ds, mask=dmask, other=0.0)
        xo += tl.load(pre_ptr + t * N + j) * sv.to(tl.float32)
    xo = xo.to(x_ptr.dtype.element_ty)                                # the block input, as unfused
    if NORM:
        # One program holds the whole row (BLOCK_D >= D, zero past D): the norm of the rounded
        # x, as _rms_norm_kernel (round_first=False) would compute it from x in memory.
        xf = xo.to(tl.float32)
        w = tl.load(w_ptr + ds, mask=dmask, other=0.0).to(tl.float32)
        xo = (xf * inv_rms(xf, D, eps) * w).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + t * x_stride + ds, xo, mask=dmask)
    if QUANT_GROUP > 0:
        # (With NORM: the whole row.) The normalised input quantised for the block's FP8
        # linears, as fp8_act_quant would quantise it.
        store_quant_groups(xo.to(tl.float32), q_ptr + t * D, qs_ptr + t * (D // QUANT_GROUP), 0, D,
                           QUANT_GROUP, POW2)


@triton.jit
def _hc_post_kernel(
    o_ptr, s_ptr, post_ptr, comb_ptr, out_ptr,
    D, o_stride, s_stride, out_stride,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr, COPIES: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)          # [BD]
    dmask = ds < D
    k = tl.arange(0, NP)
    kmask = k < N
    post = tl.load(post_ptr + t * N + k, mask=kmask, other=0.0)       # [NP]
    bo = tl.load(o_ptr + t * o_stride + ds, mask=dmask, other=0.0).to(tl.float32)
    acc = post[:, None] * bo[None, :]                                 # [NP(k), BD]
    for j in tl.static_range(N):
        cj = tl.load(comb_ptr + (t * N + j) * N + k, mask=kmask, other=0.0)     # comb[t, j, :]
        sj = tl.load(s_ptr + t * s_stride + (0 if COPIES else j * D) + ds, mask=dmask, other=0.0).to(tl.float32)
        acc += cj[:, None] * sj[None, :]
    tl.store(out_ptr + t * out_stride + k[:, None] * D + ds[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=kmask[:, None] & dmask[None, :])


class HCConfig(NamedTuple):
    """Launch config of :func:`hc_pre` / :func:`hc_head`."""

    block_t: int                  # tokens per program; >= 16 (tl.dot's minimum): tensor-core dots,
                                  # below: float32 FMAs (decode: no 16-row padding)
    block_k: int                  # columns of K per inner step
    num_splits: int | None        # programs along K per token block; None: about 2 per SM
    num_warps: int
    one_launch_max_t: int         # up to this T the finishing program also collapses
    bf16_split: bool = False      # bf16 streams, block_t >= 16: True the tile as loaded against fn
                                  # split into three bf16 parts per K step, False the float32 tile
                                  # against fn (tf32x3)
    num_stages: int = 3           # software-pipelining depth of the K loop


def pick_config(t: int, device: torch.device, dtype: torch.dtype) -> HCConfig:
    """From the H200 sweep (``scripts/gpu_kernel_check.py hyper_connection``, CUDA-graph
    replays, n 4, D 4096): one launch only for a single token (the finishing program's
    collapse is then one load wave; from T=4 on the parallel second launch wins: 21 us vs 31
    at T=16); up to 16 tokens, blocks of 1 (T=1) or 4 tokens projected with float32 FMAs
    rather than a 16-row-padded tl.dot (2026-12-04 sweep: T=1 7.2 us vs 17.9, T=4 12.0 vs
    20.3, T=16 12.9 vs 21.2); 16-token blocks over 32 K splits up to a few hundred tokens
    (20 us at T=64 vs 31 with 32-token blocks); large T takes 128-token blocks over 8 splits, so ``fn`` is
    re-read from L2 fewer times and the finishing work is amortised (232 us at T=4096 vs
    467 with 64-token blocks). Above 256 tokens, bf16 streams are multiplied as loaded
    against fn split into three bf16 parts (``bf16_split``; see the module docstring); the
    token-block shapes up to 4,095 tokens predate the split (a sweep with it, at T=4096, whole
    call incl. the collapse: 232.6 us before the split, 114.7 us with it at 128-token blocks, 104.2 us at 256-token blocks, now the default there)."""
    del device
    bf16_split = dtype == torch.bfloat16
    if t == 1:
        return HCConfig(1, 256, 64, 4, _ONE_LAUNCH_MAX_T)
    if t <= 16:
        return HCConfig(4, 64, None, 2, _ONE_LAUNCH_MAX_T)
    if t <= 256:
        return HCConfig(16, 64, 32, 4, _ONE_LAUNCH_MAX_T)
    if t <= 1024:
        return HCConfig(64, 64, None, 8, _ONE_LAUNCH_MAX_T, bf16_split)
    if t < 4096:
        return HCConfig(128, 64, 8, 8, _ONE_LAUNCH_MAX_T, bf16_split)
    return HCConfig(256, 64, 8, 8, _ONE_LAUNCH_MAX_T, bf16_split)


# Batch-invariant mode's config for every T (kernels/backend.py, :func:`invariant_config`): 128-token
# blocks on tensor-core dots over 16 fixed K splits, summed in split order, and the collapse always
# in the second launch. The launcher's choice changes the product's precision path (float32 FMAs,
# tf32x3, bf16x3), the split count and where the collapse runs with T. The block is the prefill
# shape (a decode step pads its few tokens to one block); 16-token blocks re-read fn from L2 eight
# times as often (H100, n 4, D 4,096, bf16 streams, scripts/probes/hc_invariant_configs.py: 218 us
# at T = 4,096 against 390 with 16-token blocks over 32 splits and 202 for the normal mode's
# config). At T <= 64 the probe's times were launch-bound and alike; the decode cost of the
# padding is not yet measured in the model.
INVARIANT_CONFIG = HCConfig(128, 64, 16, 8, one_launch_max_t=0)


def invariant_config(dtype: torch.dtype) -> HCConfig:
    """Batch-invariant mode's config for streams of ``dtype``, the same for every T:
    :data:`INVARIANT_CONFIG`, with bf16 streams multiplied as loaded against fn's three bf16 parts
    (``bf16_split``, as the launcher's prefill configs do: the tf32x3 path splits both operands
    every K step, the ALU work that kept the kernel at ~188 us against ~105 at T = 4,096)."""
    return INVARIANT_CONFIG._replace(bf16_split=dtype == torch.bfloat16)


def _streams_2d(streams: torch.Tensor, who: str, block_k: int = 1) -> tuple[torch.Tensor, bool]:
    """[T, n, D] -> ([T, n*D] view with unit column stride, False), copied only when it cannot
    be; or, for n copies of one row (an ``expand`` of [T, 1, D]: stream stride 0, as the first
    layer's streams are), ([T, D] view, True), which the kernels read n times instead of n
    materialised copies (``block_k`` must divide D for the projection's K tiles)."""
    if streams.dim() != 3:
        raise ValueError(f"{who}: streams must be [T, n, D], got shape {tuple(streams.shape)}")
    t, n, d = streams.shape
    if streams.stride(1) == 0 and streams.stride(2) == 1 and d % block_k == 0 and n > 1:
        return streams.as_strided((t, d), (streams.stride(0), 1)), True
    if streams.stride(2) != 1 or streams.stride(1) != d:
        streams = streams.contiguous()
    return streams.as_strided((t, n * d), (streams.stride(0), 1)), False


def _mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
         sinkhorn_iters: int, hc_eps: float, norm_eps: float, full: bool, num_splits: int | None,
         config: HCConfig | None, who: str, norm: tuple[torch.Tensor, float] | None = None,
         pre_in: torch.Tensor | None = None, fp8: tuple[int, bool] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(x, post, comb, pre, x's FP8 codes and scales or None); with ``pre_in`` [T, n] float32 the
    collapse uses it instead of the connection's own pre (which is still computed and returned);
    ``fp8`` = (group, pow2_scale), with ``norm`` only: the normalised x also quantised per group
    by the collapse launch (:func:`fp8_gemm.fp8_act_quant` of x, bit for bit)."""
    if streams.dim() != 3:
        raise ValueError(f"{who}: streams must be [T, n, D], got shape {tuple(streams.shape)}")
    t, n, d = streams.shape
    nmix = (2 + n) * n if full else n
    dev = streams.device
    if fn.shape != (nmix, n * d) or fn.dtype != torch.float32:
        raise ValueError(f"{who}: fn must be float32 [{nmix}, {n * d}], got {fn.dtype} {tuple(fn.shape)}")
    if base.shape != (nmix,) or scale.shape != ((3,) if full else (1,)):
        raise ValueError(f"{who}: base must be [{nmix}] and scale [{3 if full else 1}], got "
                         f"{tuple(base.shape)} and {tuple(scale.shape)}")
    if any(p.device != dev for p in (fn, base, scale)):
        raise ValueError(f"{who}: fn, base and scale must be on the streams' device {dev}")
    if sinkhorn_iters < 1:
        raise ValueError(f"{who}: sinkhorn_iters={sinkhorn_iters} must be >= 1")
    if norm is not None:
        if norm[0].shape != (d,) or norm[0].device != dev:
            raise ValueError(f"{who}: norm weight must be [{d}] on {dev}, got {tuple(norm[0].shape)} on "
                             f"{norm[0].device}")
        if d > MAX_COLS:
            raise ValueError(f"{who}: a norm needs the whole row in one program; D={d} exceeds {MAX_COLS}")
        norm = (norm[0].contiguous(), float(norm[1]))
    if fp8 is not None:
        if norm is None:
            raise ValueError(f"{who}: fp8 output needs the norm (the collapse then holds whole rows)")
        check_quant_group(fp8[0], d, who)
    fn, base, scale = fn.contiguous(), base.float().contiguous(), scale.float().contiguous()
    x = torch.empty(t, d, dtype=streams.dtype, device=dev)                  # [T, D]
    post = torch.empty(t, n, dtype=torch.float32, device=dev)               # [T, n]
    comb = torch.empty(t, n, n, dtype=torch.float32, device=dev)            # [T, n, n]
    pre = torch.empty(t, n, dtype=torch.float32, device=dev)                # [T, n]
    quant = None if fp8 is None else (torch.empty(t, d, dtype=torch.float8_e4m3fn, device=dev),
                                      torch.empty(t, d // fp8[0], dtype=torch.float32, device=dev))
    if pre_in is not None and (pre_in.shape != (t, n) or pre_in.dtype != torch.float32 or pre_in.device != dev):
        raise ValueError(f"{who}: pre_in must be float32 [{t}, {n}] on {dev}, got {pre_in.dtype} "
                         f"{tuple(pre_in.shape)} on {pre_in.device}")
    if t == 0:
        return x, post, comb, pre, quant

    cfg = config or pick_config(t, dev, streams.dtype)
    if num_splits is not None:
        cfg = cfg._replace(num_splits=num_splits)
    s2, copies = _streams_2d(streams, who, cfg.block_k)
    k_total = n * d
    block_t, block_k = cfg.block_t, cfg.block_k
    n_tb = triton.cdiv(t, block_t)
    splits = cfg.num_splits
    if splits is None:
        target = 2 * sm_count(dev) if dev.type == "cuda" else 4
        splits = max(1, min(triton.cdiv(k_total, _MIN_SPLIT_COLS), triton.cdiv(target, n_tb)))
    cols_per_split = triton.cdiv(triton.cdiv(k_total, splits), block_k) * block_k
    splits = triton.cdiv(k_total, cols_per_split)
    ncol = max(_MIN_DOT, triton.next_power_of_2(nmix + 1))                  # partial row: M dots, sum of squares
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"{who}: config block_t={block_t} must be a power of two")
    block_s = max(1, min(triton.next_power_of_2(splits), 8192 // (block_t * ncol)))  # splits per reduce load
    if not isinstance(cfg.bf16_split, bool):
        raise ValueError(f"{who}: config bf16_split={cfg.bf16_split!r} must be a bool")
    if cfg.bf16_split and (streams.dtype != torch.bfloat16 or block_t < _MIN_DOT):
        raise ValueError(f"{who}: config bf16_split=True needs bfloat16 streams and block_t >= "
                         f"{_MIN_DOT}, got {streams.dtype} and block_t={block_t}")
    # The norm, or a given pre: always the 2nd launch (the first then writes its own pre).
    collapse = t <= cfg.one_launch_max_t and norm is None and pre_in is None
    part = torch.empty(splits, t, ncol, dtype=torch.float32, device=dev)    # per-split partial sums
    counters = tile_counters(dev, n_tb)           # zero between launches: the kernel resets them
    _hc_pre_kernel[(splits, n_tb)](
        s2, fn, base, scale, part, counters, x, pre, post, comb,
        t, d, s2.stride(0), x.stride(0),
        cols_per_split, splits, sinkhorn_iters, hc_eps, norm_eps,
        N=n, NP=triton.next_power_of_2(n), NMIX=nmix, NCOL=ncol, FULL=full, COLLAPSE=collapse,
        PRECISION="tf32x3" if dev.type == "cuda" else "ieee", USE_DOT=block_t >= _MIN_DOT,
        BF16_SPLIT=cfg.bf16_split, BF16_DOT=dev.type == "cuda",
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_S=block_s,
        BLOCK_D=min(triton.next_power_of_2(d), 4096), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        COPIES=copies, **pdl.flags(s2.device))
    if not collapse:
        # Collapse tile: 1024 columns per program (4 warps, 8 per thread), one token per row of
        # the grid; with the norm the whole row, as the norm kernel tiles it.
        if norm is None:
            block_d, warps = min(triton.next_power_of_2(d), 1024), 4
            w_arg, eps_arg = pre, 0.0                                       # unused without NORM
        else:
            (block_d, warps), (w_arg, eps_arg) = row_config(d), norm
        weights = pre if pre_in is None else pre_in.contiguous()
        q, qs = quant or (x, x)                                             # unused without QUANT_GROUP
        _hc_collapse_kernel[(t, triton.cdiv(d, block_d))](
            s2, weights, w_arg, x, q, qs, d, s2.stride(0), x.stride(0), eps_arg, N=n, BLOCK_D=block_d,
            NORM=norm is not None, COPIES=copies, QUANT_GROUP=fp8[0] if fp8 else 0, POW2=bool(fp8 and fp8[1]),
            num_warps=warps, **pdl.flags(s2.device))
    return x, post, comb, pre, quant


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float, num_splits: int | None = None,
           config: HCConfig | None = None, norm: tuple[torch.Tensor, float] | None = None,
           fp8: tuple[int, bool] | None = None
           ) -> tuple[torch.Tensor, ...]:
    """streams [T, n, D]; fn [(2+n)*n, n*D] float32; base [(2+n)*n]; scale [3] ->
    (block input [T, D] in the streams' dtype, post [T, n] float32, comb [T, n, n] float32).
    ``norm`` (weight [D], eps): the block input comes back through the block's RMSNorm
    (``round_first=False``), equal bit for bit to :func:`rms_norm.rms_norm` of the plain result;
    with ``fp8`` = (group, pow2_scale) as well, two more: the block input's FP8 codes [T, D] and
    scales [T, D/group] (:func:`fp8_gemm.fp8_act_quant` of it, from the same launch).
    ``num_splits`` overrides the number of K splits, ``config`` the whole launch config (tests, tuning)."""
    x, post, comb, _, quant = _mix(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, True, num_splits,
                                   config, "hc_pre", norm, fp8=fp8)
    return (x, post, comb) if quant is None else (x, post, comb, *quant)


def hc_pre_lagged(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  sinkhorn_iters: int, hc_eps: float, norm_eps: float, pre_in: torch.Tensor,
                  norm: tuple[torch.Tensor, float] | None = None, num_splits: int | None = None,
                  config: HCConfig | None = None, fp8: tuple[int, bool] | None = None
                  ) -> tuple[torch.Tensor, ...]:
    """DeepSeek-V4.1's lagged connection: the block input collapses the streams with
    ``pre_in`` [T, n] float32 (the previous sublayer's pre), not with this connection's own
    pre, which is returned for the next sublayer -> (block input [T, D], pre [T, n], post
    [T, n], comb [T, n, n]), and with ``fp8`` the block input's codes and scales (as
    :func:`hc_pre`). Two launches (mixings, then the collapse with ``norm``)."""
    x, post, comb, pre, quant = _mix(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, True, num_splits,
                                     config, "hc_pre_lagged", norm, pre_in, fp8)
    return (x, pre, post, comb) if quant is None else (x, pre, post, comb, *quant)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float, num_splits: int | None = None,
            config: HCConfig | None = None) -> torch.Tensor:
    """streams [T, n, D]; fn [n, n*D] float32; base [n]; scale [1] -> [T, D] (the final collapse)."""
    return _mix(streams, fn, base, scale, 1, hc_eps, norm_eps, False, num_splits, config, "hc_head")[0]


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """block_out [T, D]; streams [T, n, D]; post [T, n] float32; comb [T, n, n] float32 ->
    new streams [T, n, D] in the streams' dtype."""
    s2, copies = _streams_2d(streams, "hc_post")
    t, n, d = streams.shape
    if block_out.shape != (t, d) or block_out.stride(-1) != 1:
        raise ValueError(f"hc_post: block_out must be [{t}, {d}] with unit column stride, got shape "
                         f"{tuple(block_out.shape)} strides {block_out.stride()}")
    if post.shape != (t, n) or comb.shape != (t, n, n):
        raise ValueError(f"hc_post: post must be [{t}, {n}] and comb [{t}, {n}, {n}], got "
                         f"{tuple(post.shape)} and {tuple(comb.shape)}")
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        raise ValueError(f"hc_post: post and comb must be float32, got {post.dtype} and {comb.dtype}")
    if any(p.device != streams.device for p in (block_out, post, comb)):
        raise ValueError(f"hc_post: block_out, post and comb must be on the streams' device {streams.device}")
    post, comb = post.contiguous(), comb.contiguous()
    out = torch.empty(t, n, d, dtype=streams.dtype, device=streams.device)  # [T, n, D]
    if t == 0:
        return out
    # Tile config: 1024 columns per program (4 warps, 8 float32 per thread and stream) once
    # there are enough tokens to fill the GPU; 256 for decode so that D still spreads over SMs.
    block_d = min(triton.next_power_of_2(d), 256 if t < 64 else 1024)
    _hc_post_kernel[(t, triton.cdiv(d, block_d))](
        block_out, s2, post, comb, out, d, block_out.stride(0), s2.stride(0), out.stride(0),
        N=n, NP=triton.next_power_of_2(n), BLOCK_D=block_d, COPIES=copies, num_warps=4,
        **pdl.flags(block_out.device))
    return out
