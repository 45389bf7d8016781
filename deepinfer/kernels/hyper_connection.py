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

The counters live in one zeroed int32 buffer per device that the finishing
program resets, so a launch needs no memset and replays under a CUDA graph. Two
launches that share a device must therefore not run concurrently on different
streams. The buffer is allocated on first use, which must not happen during
graph capture (run the model eagerly once first, as warm-up does anyway).

**post** is one elementwise launch: for each token and D tile,
``out_k = post_k * block_out + sum_j comb[j, k] * s_j`` in float32.

**post fused with the next projection** (:func:`hc_post_project`, prefill: from
``FUSE_POST_MIN_T`` tokens). Every connection's new streams are read next by another
connection (the next block's, or the head after the last layer), whose projection pass
then reads them from memory again: at T=4096 in bf16 that pass (~72 us on the H200) and
the collapse (~44 us) each read the 134 MB of streams, which hc_post has just had in
registers. So hc_post tiles (token block) x (a range of D) over all n streams, rounds
each new tile to the streams' dtype (what the projection would load), and projects it
against the next connection's fn as ``_hc_pre_kernel`` would (bf16: fn split into three
bf16 parts; float32: tf32x3), with the sum of squares, into partials
[splits, T, NCOL] (one split per D range). The next ``hc_pre``/``hc_head(partials=...)``
then runs one launch, ``_hc_finish_collapse_kernel``: one program per token (it holds the
whole row for the norm anyway) sums its partials, computes pre/post/comb (the same helpers
as the finishing program) and collapses; the streams are read once per connection and no
block counters are involved. The new streams are bit for bit hc_post's; the mixings differ
from the unfused pair's by float32 ulps (the same products summed per D range rather than
per K range), x by about an ulp of its dtype. The first connection (streams from the
embedding) and decode / small T keep the unfused pair.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.rms_norm import MAX_COLS, inv_rms, row_config
from deepinfer.kernels.split_dot import dot_bf16x3

_MIN_DOT = 16              # tl.dot needs every tile side >= 16
_ONE_LAUNCH_MAX_T = 1      # up to here the finishing program also collapses (one launch)
_MIN_SPLIT_COLS = 256      # columns of K per program at least: caps the partials to reduce
_COUNTERS: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _pre_weights(pre_raw, rs, base_ptr, scale_ptr, hc_eps, N: tl.constexpr, NP: tl.constexpr):
    """pre [BT, NP] (zero past n) from the raw pre mixes [BT, NP] and the RMS factor rs [BT]."""
    j = tl.arange(0, NP)
    jmask = j < N
    pre_b = tl.load(base_ptr + j, mask=jmask, other=0.0)
    pre = tl.sigmoid(pre_raw * rs[:, None] * tl.load(scale_ptr) + pre_b[None, :]) + hc_eps
    return tl.where(jmask[None, :], pre, 0.0)


@triton.jit
def _store_post_comb(post_raw, comb_raw, rs, toks, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr,
                     sinkhorn_iters, hc_eps, N: tl.constexpr, NP: tl.constexpr):
    """post [BT, n] and comb [BT, n, n] of tokens ``toks`` [BT] from their raw mixes
    post_raw [BT, NP], comb_raw [BT, NP, NP] and the RMS factor rs [BT]."""
    j = tl.arange(0, NP)
    jmask = j < N
    m2 = tmask[:, None] & jmask[None, :]
    post_b = tl.load(base_ptr + N + j, mask=jmask, other=0.0)
    post = 2 * tl.sigmoid(post_raw * rs[:, None] * tl.load(scale_ptr + 1) + post_b[None, :])
    tl.store(post_ptr + toks[:, None] * N + j[None, :], post, mask=m2)
    valid = jmask[:, None] & jmask[None, :]                           # [NP, NP]
    m3 = tmask[:, None, None] & valid[None, :, :]
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
    tl.store(comb_ptr + toks[:, None, None] * (N * N) + j[None, :, None] * N + j[None, None, :], comb, mask=m3)


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
    PDL: tl.constexpr = False,
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
        x = tl.load(s_ptr + toks[:, None] * s_stride + ks[None, :],
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
        pre = _pre_weights(pre_raw, rs, base_ptr, scale_ptr, hc_eps, N, NP)         # [BT, NP]

        if FULL:
            post_raw = tl.load(row0[:, None] + N + j[None, :], mask=m2, other=0.0, cache_modifier=".cg")
            comb_raw = tl.load(row0[:, None, None] + 2 * N + j[None, :, None] * N + j[None, None, :],
                               mask=tmask[:, None, None] & (jmask[:, None] & jmask[None, :])[None, :, :],
                               other=0.0, cache_modifier=".cg")       # [BT, i, j]
            _store_post_comb(post_raw, comb_raw, rs, toks, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr,
                             sinkhorn_iters, hc_eps, N, NP)

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
                        sv = tl.load(s_ptr + tok * s_stride + jj * D + ds, mask=dmask, other=0.0)
                        xo += pj * sv.to(tl.float32)
                    tl.store(x_ptr + tok * x_stride + ds, xo.to(x_ptr.dtype.element_ty), mask=dmask)
        else:
            tl.store(pre_ptr + toks[:, None] * N + j[None, :], pre, mask=m2)


@triton.jit
def _collapse_row(s_ptr, w_ptr, x_ptr, t, ds, dmask, pre, D, s_stride, x_stride, eps,
                  N: tl.constexpr, NP: tl.constexpr, NORM: tl.constexpr):
    """Store ``x = sum_j pre_j s_j`` of token t over columns ds [BD] (pre [NP] float32),
    with NORM the block's RMSNorm of it (the program then holds the whole row)."""
    j = tl.arange(0, NP)
    xo = tl.zeros(ds.shape, tl.float32)
    for jj in tl.static_range(N):                                     # stream order, as the reference
        pj = tl.sum(tl.where(j == jj, pre, 0.0), axis=0)
        sv = tl.load(s_ptr + t * s_stride + jj * D + ds, mask=dmask, other=0.0)
        xo += pj * sv.to(tl.float32)
    xo = xo.to(x_ptr.dtype.element_ty)                                # the block input, as unfused
    if NORM:
        # BLOCK_D >= D, zero past D: the norm of the rounded x, as _rms_norm_kernel
        # (round_first=False) would compute it from x in memory.
        xf = xo.to(tl.float32)
        w = tl.load(w_ptr + ds, mask=dmask, other=0.0).to(tl.float32)
        xo = (xf * inv_rms(xf, D, eps) * w).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + t * x_stride + ds, xo, mask=dmask)


@triton.jit
def _hc_collapse_kernel(
    s_ptr, pre_ptr, w_ptr, x_ptr, D, s_stride, x_stride, eps,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)          # [BD]
    j = tl.arange(0, NP)
    pre = tl.load(pre_ptr + t * N + j, mask=j < N, other=0.0)         # [NP]
    _collapse_row(s_ptr, w_ptr, x_ptr, t, ds, ds < D, pre, D, s_stride, x_stride, eps, N, NP, NORM)


@triton.jit
def _hc_finish_collapse_kernel(
    part_ptr, s_ptr, base_ptr, scale_ptr, w_ptr, x_ptr, post_ptr, comb_ptr,
    T, D, s_stride, x_stride, n_splits, sinkhorn_iters, hc_eps, norm_eps, eps,
    N: tl.constexpr, NP: tl.constexpr, NMIX: tl.constexpr, NCOL: tl.constexpr, FULL: tl.constexpr,
    NORM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """hc_pre from the partial projections hc_post left (``_hc_post_project_kernel``): one
    program per token sums its partials, computes its mixings (as _hc_pre_kernel's finishing
    program) and collapses its row."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, NP)
    jmask = j < N
    valid = jmask[:, None] & jmask[None, :]                           # [NP, NP]
    ss = tl.arange(0, BLOCK_S)
    row = part_ptr + t * NCOL                                         # split 0's partial row
    pre_raw = tl.zeros([NP], tl.float32)
    post_raw = tl.zeros([NP], tl.float32)
    comb_raw = tl.zeros([NP, NP], tl.float32)
    sq = tl.zeros([1], tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        sm = (s0 + ss) < n_splits
        srow = row + (s0 + ss).to(tl.int64) * (T * NCOL)              # [BS]
        sq += tl.sum(tl.load(srow[:, None] + NMIX + tl.zeros([1], tl.int32)[None, :], mask=sm[:, None],
                             other=0.0), axis=0)
        pre_raw += tl.sum(tl.load(srow[:, None] + j[None, :], mask=sm[:, None] & jmask[None, :], other=0.0),
                          axis=0)
        if FULL:
            post_raw += tl.sum(tl.load(srow[:, None] + N + j[None, :], mask=sm[:, None] & jmask[None, :],
                                       other=0.0), axis=0)
            comb_raw += tl.sum(tl.load(srow[:, None, None] + 2 * N + j[None, :, None] * N + j[None, None, :],
                                       mask=sm[:, None, None] & valid[None, :, :], other=0.0), axis=0)
    rs = tl.rsqrt(sq / (N * D) + norm_eps)                            # [1] RMS factor
    toks = t + tl.zeros([1], tl.int64)                                # [1] the shapes the finish takes
    pre = _pre_weights(pre_raw[None, :], rs, base_ptr, scale_ptr, hc_eps, N, NP)    # [1, NP]
    if FULL:
        _store_post_comb(post_raw[None, :], comb_raw[None, :, :], rs, toks, toks == t, base_ptr, scale_ptr,
                         post_ptr, comb_ptr, sinkhorn_iters, hc_eps, N, NP)
    pre = tl.sum(pre, axis=0)                                         # [NP]
    for d0 in range(0, D, BLOCK_D):                                   # NORM: one step (BLOCK_D >= D)
        ds = d0 + tl.arange(0, BLOCK_D)
        _collapse_row(s_ptr, w_ptr, x_ptr, t, ds, ds < D, pre, D, s_stride, x_stride, eps, N, NP, NORM)


@triton.jit
def _hc_post_kernel(
    o_ptr, s_ptr, post_ptr, comb_ptr, out_ptr,
    D, o_stride, s_stride, out_stride,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
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
        sj = tl.load(s_ptr + t * s_stride + j * D + ds, mask=dmask, other=0.0).to(tl.float32)
        acc += cj[:, None] * sj[None, :]
    tl.store(out_ptr + t * out_stride + k[:, None] * D + ds[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=kmask[:, None] & dmask[None, :])


@triton.jit
def _hc_post_project_kernel(
    o_ptr, s_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, part_ptr,
    T, D, o_stride, s_stride, out_stride, d_per_split,
    N: tl.constexpr, NP: tl.constexpr, NMIX: tl.constexpr, NCOL: tl.constexpr,
    PRECISION: tl.constexpr, BF16_SPLIT: tl.constexpr, BF16_DOT: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """_hc_post_kernel over a (token block) x (D range) tile of all n streams, which also
    projects the new streams, rounded to their dtype, against the next connection's fn:
    the partial sums [BT, NCOL] of this D range go to ``part`` as _hc_pre_kernel's."""
    pdl.enter(PDL)
    split = tl.program_id(0)
    tb = tl.program_id(1)
    K = N * D
    toks = (tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)         # [BT]
    tmask = toks < T
    k = tl.arange(0, NP)
    tk_mask = tmask[:, None] & (k < N)[None, :]                        # [BT, NP]
    cols = tl.arange(0, NCOL)
    # The flattened [NP * BD] columns of a step: stream kf[i], column dd[i] of the D tile.
    kd = tl.arange(0, NP * BLOCK_D)
    kf = kd // BLOCK_D
    dd = kd % BLOCK_D
    post = tl.load(post_ptr + toks[:, None] * N + k[None, :], mask=tk_mask, other=0.0)   # [BT, NP]
    acc = tl.zeros([BLOCK_T, NCOL], tl.float32)                       # [BT, NCOL] s' @ fn.T
    sq = tl.zeros([BLOCK_T], tl.float32)                              # [BT] sum of s'^2
    d_begin = split * d_per_split
    for d0 in range(0, d_per_split, BLOCK_D):
        ds = d_begin + d0 + tl.arange(0, BLOCK_D)                     # [BD]
        m2 = tmask[:, None] & (ds < D)[None, :]                       # [BT, BD]
        bo = tl.load(o_ptr + toks[:, None] * o_stride + ds[None, :], mask=m2, other=0.0).to(tl.float32)
        new = post[:, :, None] * bo[:, None, :]                       # [BT, NP(k), BD]
        for j in tl.static_range(N):                                  # as _hc_post_kernel, in stream order
            cj = tl.load(comb_ptr + (toks[:, None] * N + j) * N + k[None, :], mask=tk_mask, other=0.0)
            sj = tl.load(s_ptr + toks[:, None] * s_stride + j * D + ds[None, :], mask=m2, other=0.0)
            new += cj[:, :, None] * sj.to(tl.float32)[:, None, :]
        new = new.to(out_ptr.dtype.element_ty)                        # zero past T, n and D
        tl.store(out_ptr + toks[:, None, None] * out_stride + k[None, :, None] * D + ds[None, None, :], new,
                 mask=tk_mask[:, :, None] & (ds < D)[None, None, :])
        # The projection, as _hc_pre_kernel would compute it from these streams in memory.
        x = tl.reshape(new, [BLOCK_T, NP * BLOCK_D])                  # [BT, NP*BD] column kf*BD + dd
        xf = x.to(tl.float32)
        fk = kf * D + d_begin + d0 + dd                               # [NP*BD] columns of fn
        fmask = (kf < N) & (d_begin + d0 + dd < D)
        w_ptrs = fn_ptr + cols[None, :] * K + fk[:, None]             # [NP*BD, NCOL]
        wmask = fmask[:, None] & (cols[None, :] < NMIX)
        if BF16_SPLIT:
            acc = dot_bf16x3(x, tl.load(w_ptrs, mask=wmask, other=0.0), acc, BF16_DOT)
        else:
            acc = tl.dot(xf, tl.load(w_ptrs, mask=wmask, other=0.0), acc, input_precision=PRECISION)
        sq += tl.sum(xf * xf, axis=1)
    acc = tl.where(cols[None, :] == NMIX, sq[:, None], acc)
    tl.store(part_ptr + split * T * NCOL + toks[:, None] * NCOL + cols[None, :], acc, mask=tmask[:, None])


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
    token-block shapes up to 4,095 tokens predate the split (``scripts/probes/hc_pre_prefill_sweep.py``
    sweeps them with it: at T=4096, whole call incl. the collapse, 232.6 us before the split,
    114.7 us with it at 128-token blocks, 104.2 us at 256-token blocks, now the default there)."""
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


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _zeroed_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters, zero between launches (the kernel resets the ones it uses)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"hc_pre: the kernel's {n} block counters must be allocated before CUDA-graph "
                               "capture; run one eager forward with at least as many tokens first")
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def _streams_2d(streams: torch.Tensor, who: str) -> torch.Tensor:
    """[T, n, D] -> [T, n*D] view with unit column stride (copied only when it cannot be)."""
    if streams.dim() != 3:
        raise ValueError(f"{who}: streams must be [T, n, D], got shape {tuple(streams.shape)}")
    t, n, d = streams.shape
    if streams.stride(2) != 1 or streams.stride(1) != d:
        streams = streams.contiguous()
    return streams.as_strided((t, n * d), (streams.stride(0), 1))


def _ncol(nmix: int) -> int:
    """Width of a partial row: the M dot products, the sum of squares, padded for tl.dot."""
    return max(_MIN_DOT, triton.next_power_of_2(nmix + 1))


def _mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
         sinkhorn_iters: int, hc_eps: float, norm_eps: float, full: bool, num_splits: int | None,
         config: HCConfig | None, who: str, norm: tuple[torch.Tensor, float] | None = None,
         partials: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s2 = _streams_2d(streams, who)
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
    ncol = _ncol(nmix)
    if partials is not None and (partials.dim() != 3 or partials.shape[1:] != (t, ncol)
                                 or partials.dtype != torch.float32 or partials.device != dev
                                 or not partials.is_contiguous()):
        raise ValueError(f"{who}: partials must be contiguous float32 [splits, {t}, {ncol}] on {dev} (from "
                         f"hc_post_project with this connection's fn), got {partials.dtype} "
                         f"{tuple(partials.shape)} on {partials.device}")
    fn, base, scale = fn.contiguous(), base.float().contiguous(), scale.float().contiguous()
    x = torch.empty(t, d, dtype=streams.dtype, device=dev)                  # [T, D]
    post = torch.empty(t, n, dtype=torch.float32, device=dev)               # [T, n]
    comb = torch.empty(t, n, n, dtype=torch.float32, device=dev)            # [T, n, n]
    if t == 0:
        return x, post, comb
    # Collapse tile: 1024 columns (4 warps, 8 per thread); with the norm the whole row, as the
    # norm kernel tiles it.
    if norm is None:
        block_d, warps = min(triton.next_power_of_2(d), 1024), 4
        w_arg, eps_arg = base, 0.0                                          # unused without NORM
    else:
        (block_d, warps), (w_arg, eps_arg) = row_config(d), norm

    if partials is not None:
        # The projection was done by hc_post: one program per token finishes and collapses.
        splits = partials.shape[0]
        _hc_finish_collapse_kernel[(t,)](
            partials, s2, base, scale, w_arg, x, post, comb,
            t, d, s2.stride(0), x.stride(0), splits, sinkhorn_iters, hc_eps, norm_eps, eps_arg,
            N=n, NP=triton.next_power_of_2(n), NMIX=nmix, NCOL=ncol, FULL=full, NORM=norm is not None,
            BLOCK_S=min(triton.next_power_of_2(splits), 16), BLOCK_D=block_d, num_warps=warps,
            **pdl.flags(s2.device))
        return x, post, comb

    cfg = config or pick_config(t, dev, streams.dtype)
    if num_splits is not None:
        cfg = cfg._replace(num_splits=num_splits)
    k_total = n * d
    block_t, block_k = cfg.block_t, cfg.block_k
    n_tb = triton.cdiv(t, block_t)
    splits = cfg.num_splits
    if splits is None:
        target = 2 * _sm_count(dev) if dev.type == "cuda" else 4
        splits = max(1, min(triton.cdiv(k_total, _MIN_SPLIT_COLS), triton.cdiv(target, n_tb)))
    cols_per_split = triton.cdiv(triton.cdiv(k_total, splits), block_k) * block_k
    splits = triton.cdiv(k_total, cols_per_split)
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"{who}: config block_t={block_t} must be a power of two")
    block_s = max(1, min(triton.next_power_of_2(splits), 8192 // (block_t * ncol)))  # splits per reduce load
    if not isinstance(cfg.bf16_split, bool):
        raise ValueError(f"{who}: config bf16_split={cfg.bf16_split!r} must be a bool")
    if cfg.bf16_split and (streams.dtype != torch.bfloat16 or block_t < _MIN_DOT):
        raise ValueError(f"{who}: config bf16_split=True needs bfloat16 streams and block_t >= "
                         f"{_MIN_DOT}, got {streams.dtype} and block_t={block_t}")
    collapse = t <= cfg.one_launch_max_t and norm is None              # the norm: always the 2nd launch
    part = torch.empty(splits, t, ncol, dtype=torch.float32, device=dev)    # per-split partial sums
    pre = torch.empty(t, n, dtype=torch.float32, device=dev)                # [T, n] for the 2nd launch
    counters = _zeroed_counters(dev, n_tb)
    _hc_pre_kernel[(splits, n_tb)](
        s2, fn, base, scale, part, counters, x, pre, post, comb,
        t, d, s2.stride(0), x.stride(0),
        cols_per_split, splits, sinkhorn_iters, hc_eps, norm_eps,
        N=n, NP=triton.next_power_of_2(n), NMIX=nmix, NCOL=ncol, FULL=full, COLLAPSE=collapse,
        PRECISION="tf32x3" if dev.type == "cuda" else "ieee", USE_DOT=block_t >= _MIN_DOT,
        BF16_SPLIT=cfg.bf16_split, BF16_DOT=dev.type == "cuda",
        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_S=block_s,
        BLOCK_D=min(triton.next_power_of_2(d), 4096), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl.flags(s2.device))
    if not collapse:                                                    # one token per row of the grid
        _hc_collapse_kernel[(t, triton.cdiv(d, block_d))](
            s2, pre, w_arg, x, d, s2.stride(0), x.stride(0), eps_arg, N=n, NP=triton.next_power_of_2(n),
            BLOCK_D=block_d, NORM=norm is not None, num_warps=warps, **pdl.flags(s2.device))
    return x, post, comb


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float, num_splits: int | None = None,
           config: HCConfig | None = None, norm: tuple[torch.Tensor, float] | None = None,
           partials: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, D]; fn [(2+n)*n, n*D] float32; base [(2+n)*n]; scale [3] ->
    (block input [T, D] in the streams' dtype, post [T, n] float32, comb [T, n, n] float32).
    ``norm`` (weight [D], eps): the block input comes back through the block's RMSNorm
    (``round_first=False``), equal bit for bit to :func:`rms_norm.rms_norm` of the plain result.
    ``partials``: the projection of these streams against ``fn`` that :func:`hc_post_project`
    computed while writing them; the call then only finishes and collapses (one launch).
    ``num_splits`` overrides the number of K splits, ``config`` the whole launch config (tests, tuning)."""
    return _mix(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, True, num_splits, config,
                "hc_pre", norm, partials)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float, num_splits: int | None = None,
            config: HCConfig | None = None, partials: torch.Tensor | None = None) -> torch.Tensor:
    """streams [T, n, D]; fn [n, n*D] float32; base [n]; scale [1] -> [T, D] (the final collapse).
    ``partials`` as for :func:`hc_pre`, from :func:`hc_post_project` with the head's fn."""
    return _mix(streams, fn, base, scale, 1, hc_eps, norm_eps, False, num_splits, config, "hc_head",
                partials=partials)[0]


def _post_args(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
               who: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked hc_post arguments: (streams [T, n*D], post, comb contiguous, new streams [T, n, D])."""
    s2 = _streams_2d(streams, who)
    t, n, d = streams.shape
    if block_out.shape != (t, d) or block_out.stride(-1) != 1:
        raise ValueError(f"{who}: block_out must be [{t}, {d}] with unit column stride, got shape "
                         f"{tuple(block_out.shape)} strides {block_out.stride()}")
    if post.shape != (t, n) or comb.shape != (t, n, n):
        raise ValueError(f"{who}: post must be [{t}, {n}] and comb [{t}, {n}, {n}], got "
                         f"{tuple(post.shape)} and {tuple(comb.shape)}")
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        raise ValueError(f"{who}: post and comb must be float32, got {post.dtype} and {comb.dtype}")
    if any(p.device != streams.device for p in (block_out, post, comb)):
        raise ValueError(f"{who}: block_out, post and comb must be on the streams' device {streams.device}")
    out = torch.empty(t, n, d, dtype=streams.dtype, device=streams.device)  # [T, n, D]
    return s2, post.contiguous(), comb.contiguous(), out


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """block_out [T, D]; streams [T, n, D]; post [T, n] float32; comb [T, n, n] float32 ->
    new streams [T, n, D] in the streams' dtype."""
    s2, post, comb, out = _post_args(block_out, streams, post, comb, "hc_post")
    t, n, d = streams.shape
    if t == 0:
        return out
    # Tile config: 1024 columns per program (4 warps, 8 float32 per thread and stream) once
    # there are enough tokens to fill the GPU; 256 for decode so that D still spreads over SMs.
    block_d = min(triton.next_power_of_2(d), 256 if t < 64 else 1024)
    _hc_post_kernel[(t, triton.cdiv(d, block_d))](
        block_out, s2, post, comb, out, d, block_out.stride(0), s2.stride(0), out.stride(0),
        N=n, NP=triton.next_power_of_2(n), BLOCK_D=block_d, num_warps=4, **pdl.flags(block_out.device))
    return out


class PostConfig(NamedTuple):
    """Launch config of :func:`hc_post_project`."""

    block_t: int                  # tokens per program: a power of two >= 16 (tl.dot's minimum)
    block_d: int                  # columns of D per step (times n streams: the step's K columns)
    num_splits: int | None        # programs along D per token block; None: about 2 per SM
    num_warps: int
    num_stages: int = 3           # software-pipelining depth of the D loop


# From this many tokens on the backend fuses the next projection into hc_post (see the module
# docstring): where hc_pre takes its prefill configs (pick_config's bf16 split), the streams
# (>= 8 MiB in bf16 at V4-Flash widths) stop fitting comfortably in L2 for the re-read, and a
# token block of 64 still leaves enough programs to fill the GPU. Decode and small batches keep
# the unfused pair, whose configs were tuned for them.
FUSE_POST_MIN_T = 257


def fuses_post(t: int) -> bool:
    """Whether hc_post of T tokens should also project for the next connection."""
    return t >= FUSE_POST_MIN_T


def pick_post_config(t: int, device: torch.device, dtype: torch.dtype) -> PostConfig:
    """64-token blocks, 64 columns of each stream per step (K 256 per step for n 4), D split
    to about two programs per SM. Not yet swept on the H200 (``scripts/probes/hc_post_fuse.py``)."""
    del t, device, dtype
    return PostConfig(64, 64, None, 8)


def hc_post_project(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                    next_fn: torch.Tensor, config: PostConfig | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`hc_post`, which also projects the new streams against ``next_fn`` (float32
    [M, n*D]: the fn of the connection or head that reads them next) ->
    (new streams [T, n, D], partials [splits, T, NCOL] float32 for that connection's
    ``hc_pre`` / ``hc_head(partials=...)``). ``config`` overrides the launch config (tests, tuning)."""
    s2, post, comb, out = _post_args(block_out, streams, post, comb, "hc_post_project")
    t, n, d = streams.shape
    dev = streams.device
    nmix = next_fn.shape[0]
    if next_fn.shape != (nmix, n * d) or next_fn.dtype != torch.float32 or next_fn.device != dev:
        raise ValueError(f"hc_post_project: next_fn must be float32 [M, {n * d}] on {dev}, got "
                         f"{next_fn.dtype} {tuple(next_fn.shape)} on {next_fn.device}")
    cfg = config or pick_post_config(t, dev, streams.dtype)
    block_t, block_d = cfg.block_t, cfg.block_d
    if block_t < _MIN_DOT or block_t & (block_t - 1) or block_d < 1 or block_d & (block_d - 1):
        raise ValueError(f"hc_post_project: config block_t={block_t} must be a power of two >= {_MIN_DOT} "
                         f"and block_d={block_d} a power of two")
    ncol = _ncol(nmix)
    n_tb = triton.cdiv(t, block_t)
    splits = cfg.num_splits
    if splits is None:
        target = 2 * _sm_count(dev) if dev.type == "cuda" else 4
        splits = max(1, min(triton.cdiv(d, block_d), triton.cdiv(target, n_tb)))
    d_per_split = triton.cdiv(triton.cdiv(d, splits), block_d) * block_d
    splits = triton.cdiv(d, d_per_split)
    part = torch.empty(splits, t, ncol, dtype=torch.float32, device=dev)    # per-split partial sums
    if t == 0:
        return out, part
    _hc_post_project_kernel[(splits, n_tb)](
        block_out, s2, post, comb, out, next_fn.contiguous(), part,
        t, d, block_out.stride(0), s2.stride(0), out.stride(0), d_per_split,
        N=n, NP=triton.next_power_of_2(n), NMIX=nmix, NCOL=ncol,
        PRECISION="tf32x3" if dev.type == "cuda" else "ieee", BF16_SPLIT=streams.dtype == torch.bfloat16,
        BF16_DOT=dev.type == "cuda", BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.flags(dev))
    return out, part
