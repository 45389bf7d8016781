"""The MoE router's float32 logits ``x @ W.T`` as Triton kernels; reference:
:func:`reference.router_logits`.

Shapes: T tokens, H hidden, E experts; x [T, H] in bf16, fp16 or float32, W [E, H]
float32 (DeepSeek keeps its routers in float32: 4 MiB at V4-Flash widths, E=256,
H=4096) -> logits [T, E] float32. x is read in its own dtype and widened in
registers (no float32 copy of x); products accumulate in float32.

Two kernels, chosen by T (:func:`pick_config`):

- few tokens (decode): float32 FMAs. A program owns BLOCK_E expert rows and BLOCK_T
  tokens and walks H in BLOCK_K steps, accumulating ``x[t, k] * W[e, k]`` in a
  [BLOCK_T, BLOCK_E, BLOCK_K] register tile that is summed over k once, at the end.
  W is the traffic (x is tiny and L2-resident): rows in blocks of 2 give 128 programs
  at E=256, about one per SM, each streaming 32 KiB of W. No tl.dot consumes the
  loads, so the loop asks for software pipelining itself (``tl.range(num_stages=)``).
- more tokens: tensor-core tiles, ``tl.dot`` of a BLOCK_T x BLOCK_K tile of x and a
  BLOCK_K x BLOCK_E tile of W.T. For bf16 x, the tile as loaded against W's tile split into
  three bf16 parts (``split_dot.dot_bf16x3``: float32 accuracy on bf16 tensor cores, half
  the work of tf32x3). Otherwise x widened to float32 and tf32x3 (each operand split into
  a TF32 high and low part, three TF32 products: about float32 accuracy). The CPU
  interpreter computes both in float32.

Either kernel can split H into ``split_k`` ranges, for more programs when the tiles
alone do not fill the GPU (E=256 at T=64 is 8 tiles of 32 experts): each range writes a
float32 partial [S, T, E] and a second launch sums the partials in split order. No
atomics, so the logits are bitwise reproducible from run to run; the grids depend only
on the shapes (no host synchronisation, CUDA-graph capturable).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl
from deepinfer.kernels.launch import sm_count
from deepinfer.kernels.split_dot import dot_bf16x3

_FMA_MAX_T = 16            # up to here float32 FMAs, above tensor-core tiles
_FMA_TILE = 4096           # BLOCK_T * BLOCK_E * BLOCK_K of the FMA accumulator: 32 registers/thread, 4 warps
_MIN_SPLIT_COLS = 256      # columns of H per split at least
_SUM_BLOCK = 1024          # logits per program of the split sum
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class RouterConfig(NamedTuple):
    """Launch config of :func:`router_logits`."""

    dot: bool           # tensor-core tiles (tl.dot, BLOCK_T >= 16) or float32 FMAs
    block_t: int        # tokens per program (a power of two)
    block_e: int        # experts per program (a power of two)
    block_k: int        # columns of H per step (a power of two)
    split_k: int        # ranges of H, each its own programs, summed by a second launch (1: none)
    num_warps: int
    num_stages: int


@triton.jit
def _router_fma_kernel(
    x_ptr, w_ptr, part_ptr,
    T, E, H, cols_per_split, stride_x, stride_w,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    rows = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)                # [BE] experts
    split = tl.program_id(1)
    toks = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)               # [BT]
    rmask = rows < E
    tmask = toks < T
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w                  # [BE, 1]
    x_rows = x_ptr + toks[:, None].to(tl.int64) * stride_x                  # [BT, 1]
    kk = tl.arange(0, BLOCK_K)
    k_begin = split * cols_per_split
    k_end = tl.minimum(k_begin + cols_per_split, H)
    acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_K], tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + kk
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=rmask[:, None], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=tmask[:, None], other=0.0)
        else:
            kmask = ks < k_end
            w = tl.load(w_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_rows + ks[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]                # [BT, BE, BK]
    logits = tl.sum(acc, axis=2)                                            # [BT, BE]
    out = part_ptr + split.to(tl.int64) * T * E + toks[:, None].to(tl.int64) * E + rows[None, :]
    tl.store(out, logits, mask=tmask[:, None] & rmask[None, :])


@triton.jit
def _router_dot_kernel(
    x_ptr, w_ptr, part_ptr,
    T, E, H, cols_per_split, stride_x, stride_w,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BF16_SPLIT: tl.constexpr, BF16_DOT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    n_eb = tl.cdiv(E, BLOCK_E)
    pid = tl.program_id(0)
    toks = (pid // n_eb) * BLOCK_T + tl.arange(0, BLOCK_T)                  # [BT]
    rows = (pid % n_eb) * BLOCK_E + tl.arange(0, BLOCK_E)                   # [BE] experts
    split = tl.program_id(1)
    tmask = toks < T
    rmask = rows < E
    kk = tl.arange(0, BLOCK_K)
    k_begin = split * cols_per_split
    k_end = tl.minimum(k_begin + cols_per_split, H)
    x_ptrs = x_ptr + toks[:, None].to(tl.int64) * stride_x + (k_begin + kk)[None, :]   # [BT, BK]
    w_ptrs = w_ptr + rows[None, :].to(tl.int64) * stride_w + (k_begin + kk)[:, None]   # [BK, BE] of W.T
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=tmask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=rmask[None, :], other=0.0)
        else:
            kmask = k0 + kk < k_end
            x = tl.load(x_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=kmask[:, None] & rmask[None, :], other=0.0)
        if BF16_SPLIT:                                  # bf16 x times W's three bf16 parts
            acc = dot_bf16x3(x, w, acc, BF16_DOT)
        else:
            acc = tl.dot(x.to(tl.float32), w, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = part_ptr + split.to(tl.int64) * T * E + toks[:, None].to(tl.int64) * E + rows[None, :]
    tl.store(out, acc, mask=tmask[:, None] & rmask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, n, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """out[i] = sum_s part[s, i], s in order (reproducible, unlike atomic adds)."""
    pdl.enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * n + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc, mask=mask)


def pick_config(t: int, e: int, h: int, device: torch.device) -> RouterConfig:
    """Tiles by T, then K splits until the grid has about one program per SM.

    T <= 16: float32 FMAs over blocks of 2 experts (128 programs at E=256) and of up to 8
    tokens, BLOCK_K as wide as a 4096-element accumulator allows (1024 at T=1, 256 at
    T=8 and 16), 3 pipelined stages (H200: 2.3 us at T=1, against 6.5 for the cast and
    cuBLAS's float32 GEMV). Up to 1024 tokens: 64 x 32 tiles, split along H (16 ways at
    T=64); beyond: 128 x 64 tiles, 64-column steps, 8 warps, split 2 ways along H (H200
    sweep at T=4096 with bf16 x on W's three bf16 parts: 66 us, against 81 for 128 x 128
    tiles split 2 ways and 87 for 128 x 64 unsplit; 109 us before, with tf32x3).
    Tiles never exceed the (power-of-2 rounded) problem, so tiny test shapes stay tiny.
    """
    e2, h2 = triton.next_power_of_2(e), triton.next_power_of_2(h)
    if t <= _FMA_MAX_T:
        # At most 8 tokens a program: at T=16 two token blocks of 8 take 5.0 us against 8.6
        # for one of 16 (H200, CUDA-graph replays, E=256, H=4096).
        block_t, block_e = min(8, triton.next_power_of_2(t)), min(2, e2)
        block_k = min(h2, max(64, min(1024, _FMA_TILE // (block_t * block_e))))
        dot, num_warps, num_stages = False, 4, 3
    elif t <= 1024:
        block_t, block_e, block_k = min(64, max(16, triton.next_power_of_2(t))), 32, 64
        dot, num_warps, num_stages = True, 4, 3
    else:
        block_t, block_e, block_k = 128, 64, 64
        dot, num_warps, num_stages = True, 8, 3
    if dot:
        block_e, block_k = max(16, min(block_e, e2)), max(16, min(block_k, h2))
    tiles = triton.cdiv(t, block_t) * triton.cdiv(e, block_e)
    # Off CUDA, 8 SMs: the interpreter gets small grids and still exercises the splits.
    split = max(1, min(sm_count(device, interpreter=8) // tiles, h // _MIN_SPLIT_COLS))
    if t > 1024:
        split = max(1, min(2, h // _MIN_SPLIT_COLS))     # a wave of tiles is not enough (sweep above)
    return RouterConfig(dot, block_t, block_e, block_k, split, num_warps, num_stages)


def invariant_config(weight: torch.Tensor) -> RouterConfig:
    """Batch-invariant mode's config for weight [E, H], the same for every T: 64-token tensor-core
    tiles of 32 experts, H cut into a fixed number of ranges (from H alone: 256 columns each, at
    most 16), their partials summed in range order by the second launch. The launcher's choice
    switches between float32 FMAs and tensor-core tiles, and splits H, by T; these ranges keep a
    decode step's grid wide (128 programs at E=256, H=4096, each streaming 32 KiB of W, where
    one range a tile left 8 programs streaming 512 KiB each: 54 us a call on an H100)."""
    e, h = weight.shape
    e2, h2 = triton.next_power_of_2(e), triton.next_power_of_2(h)
    split = max(1, min(16, h // _MIN_SPLIT_COLS))
    return RouterConfig(True, 64, max(16, min(32, e2)), max(16, min(64, h2)), split, num_warps=4, num_stages=3)


def router_logits(x: torch.Tensor, weight: torch.Tensor, config: RouterConfig | None = None) -> torch.Tensor:
    """``x @ weight.T`` in float32: x [T, H] (bf16, fp16 or float32), weight [E, H] float32
    -> [T, E] float32. ``config`` overrides :func:`pick_config` (tests, tuning)."""
    if x.dim() != 2:
        raise ValueError(f"router_logits: x must be [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    if weight.dim() != 2 or weight.shape[1] != h:
        raise ValueError(f"router_logits: weight has shape {tuple(weight.shape)}, expected [E, H={h}]")
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"router_logits: x must be bfloat16, float16 or float32, got {x.dtype}")
    if weight.dtype != torch.float32:
        raise ValueError(f"router_logits: weight must be float32, got {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"router_logits: x on {x.device} but weight on {weight.device}")
    for name, a in (("x", x), ("weight", weight)):
        if a.stride(1) != 1:
            raise ValueError(f"router_logits: {name} must have unit stride in its last dim, "
                             f"got strides {a.stride()}")
    e = weight.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)           # [T, E]
    if t == 0 or e == 0:
        return out
    if h == 0:
        return out.zero_()
    cfg = config or pick_config(t, e, h, x.device)
    if cfg.dot and min(cfg.block_t, cfg.block_e, cfg.block_k) < 16:
        raise ValueError(f"router_logits: {cfg} has a tile side under 16, tl.dot's minimum")
    cols_per_split = triton.cdiv(triton.cdiv(h, cfg.split_k), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(h, cols_per_split)                                 # no empty split
    part = out if splits == 1 else torch.empty(splits, t, e, dtype=torch.float32, device=x.device)
    args = (x, weight, part, t, e, h, cols_per_split, x.stride(0), weight.stride(0))
    even_k = h % cfg.block_k == 0
    if cfg.dot:
        _router_dot_kernel[(triton.cdiv(t, cfg.block_t) * triton.cdiv(e, cfg.block_e), splits)](
            *args, BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k, EVEN_K=even_k,
            PRECISION="tf32x3" if x.is_cuda else "ieee", BF16_SPLIT=x.dtype == torch.bfloat16,
            BF16_DOT=x.is_cuda, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **pdl.flags(x.device))
    else:
        _router_fma_kernel[(triton.cdiv(e, cfg.block_e), splits, triton.cdiv(t, cfg.block_t))](
            *args, BLOCK_T=cfg.block_t, BLOCK_E=cfg.block_e, BLOCK_K=cfg.block_k, EVEN_K=even_k,
            NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps, **pdl.flags(x.device))
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(t * e, _SUM_BLOCK),)](
            part, out, t * e, SPLITS=splits, BLOCK=_SUM_BLOCK, num_warps=4, **pdl.flags(x.device))
    return out
