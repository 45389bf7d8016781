"""Fused mixture-of-experts: routed SwiGLU experts as two grouped GEMMs over
tokens sorted by expert; references: :func:`reference.moe_experts` (Qwen3-MoE,
DeepSeek-V3) and :func:`reference.clamped_moe_experts` (DeepSeek-V4).

Four kernels, no host synchronisation (the grids are sized from T, K and E
alone, so the whole forward can be captured in a CUDA graph):

* align (grid E + 1): program e counts the (token, slot) pairs routed to
  expert e, claims a ``BLOCK_M``-aligned run of the sorted array with one atomic
  add on a cursor, and writes its pair ids there in pair order (padding = T*K,
  "no pair") and e as the expert of those M-blocks; the last program zeroes the
  output rows of pairs whose id is outside [0, E) (e.g. -1). Runs land in
  whatever order the atomics resolve, but a pair's row within its M-block is
  fixed and each row of a GEMM tile is computed independently of the others, so
  outputs are bitwise reproducible. The cursor ends as the padded total, at most
  ``T*K + min(T*K, E)*(BLOCK_M-1)``; that bound sizes the GEMM grids, and
  M-blocks past the total exit at once.
* gate_up (grid M-blocks x I/BLOCK_N): rows of x gathered by pair, times the
  block's expert's gate rows and up rows (two float32 accumulators), SwiGLU
  with the optional clamp in the epilogue; writes act [T*K, I] by pair.
* down (grid M-blocks x H/BLOCK_N): act rows times the expert's down_proj,
  multiplied by the pair's float32 routing weight in the epilogue (the order of
  DeepSeek-V4's reference: clamp, then weight in float32); writes [T*K, H] by
  pair, rounded once to x's dtype. A fourth launch sums each token's K rows in float32
  (rounded once).

Only the weights of experts that received tokens are read. Decode (few tokens
per expert) is weight-bandwidth bound: small M-blocks (16 rows, tensor-core
minimum) and narrow N-tiles give each touched expert many programs, so even one
token's 6 experts spread over the SMs. Prefill (V4-Flash at T=4096: ~96 rows per
expert, under the H200's ~185 FLOP per weight byte, so still bound by the weights):
128-row M-blocks, grouped program order so M-blocks of one expert reuse its weight
tiles from L2. :func:`pick_config` holds the choice.

Prefill operand options (``MoEConfig`` flags; :func:`pick_config` turns both on for the
prefill tiles). At T=4096 the two GEMMs stream 12.9 GB of weights; with pointer loads they ran
at ~79% of copy bandwidth, against ~97% at T=512: the padded 128-row tensor-core work did not
hide behind the weight stream. The options free registers and issue wider copies so more
weight bytes are in flight per SM (83% with both, H200 sweep
``scripts/probes/fused_moe_prefill_sweep.py``; also gathering x into sorted rows first and
persistent grids were measured there and gained nothing, so they are not offered):

* ``tma``: weight tiles by host-side TMA descriptors over each weight tensor as one [E*N, K]
  matrix (the experts must be stacked that way, 16-byte aligned rows; the launcher checks).
  A ragged last N-tile reads the next rows (up rows, the next expert), which feed only output
  columns the store masks; past K the descriptor fills zeros.
* ``sorted_act``: gate_up writes act by sorted row ([L, I]) rather than by pair, so down's
  operand rows are contiguous (one TMA tile with ``tma``); down still stores by pair.

Rows of the sorted buffers that hold no pair (padding) are never written: they feed only
padding rows of a tile, which are never stored (each output row of an MMA depends on its
own operand row alone), so outputs stay bitwise reproducible. Both options run in the CPU
interpreter as well (it implements descriptor loads), which the tests use.

Packed weights (``packed=True``; :func:`pack_expert_weights`, the layout the layers store on CUDA
once loaded). Stacked, a [128, 64] prefill box is 128 rows of 128 bytes, 4-8 KB apart, and the
weights streamed at 83-85% of the copy rate; packed, each [tile_n, tile_k] tile of an expert
(``GATE_UP_TILE``, ``DOWN_TILE``: the prefill boxes) is one contiguous run. H200, V4-Flash widths
(measured 2026-12-04): gate_up + down at T=4096 3,550-3,578 us stacked against
3,371-3,394 us packed (84% -> 88-89% of the copy rate), the whole fused_moe 4-8% faster; the decode
configs' pointer loads 1.5% faster at T=16 and 64, equal at T=1. Every config reads them: TMA
boxes that lie inside one tile (block_k = tile_k, block_n dividing tile_n and the gate/up
boundary) load as [block_n, tile_k] runs of the packed rows; any other config loads by pointer,
each element's address from its tile (the n and k parts of the address add, so a program
computes one [BLOCK_N] and one [BLOCK_K] offset vector per step). Outputs are bitwise those of
the stacked weights under the same tiles.

Shapes: T tokens, H hidden, E experts, K experts per token, I expert width,
P = T*K (token, slot) pairs; pair p is token p // K, slot p % K.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer.kernels import pdl


@dataclass(frozen=True)
class MoEConfig:
    """Tile shapes of the two grouped GEMMs (GEMM1: gate_up, GEMM2: down)."""

    block_m: int        # pairs per M-block (one expert per block)
    block_n1: int       # GEMM1 output columns of I per program (each of gate and up)
    block_k1: int       # GEMM1 reduction step over H
    block_n2: int       # GEMM2 output columns of H per program
    block_k2: int       # GEMM2 reduction step over I
    group_m: int        # M-blocks that walk the N-tiles together (L2 reuse of weight tiles)
    num_warps: int
    num_stages: int
    tma: bool = False         # weight tiles (and down's sorted act tiles) by host-side TMA descriptors
    sorted_act: bool = False  # act in sorted rows: down's operand rows are contiguous


# [tile_n, tile_k] of the packed expert weights: the prefill config's TMA boxes (pick_config), so
# each box the prefill GEMMs read is one contiguous run (16 KB of gate_up, 32 KB of down in bf16).
GATE_UP_TILE = (128, 64)
DOWN_TILE = (256, 64)


def packed_shape(num_experts: int, n: int, k: int, tile: tuple[int, int],
                 name: str = "weights") -> tuple[int, int, int]:
    """Shape of [E, N, K] expert weights packed in [tile_n, tile_k] tiles:
    [E, (N/tile_n) * (K/tile_k) * tile_n, tile_k]. Raises ValueError unless the tiles divide N and K."""
    tile_n, tile_k = tile
    if n % tile_n or k % tile_k:
        raise ValueError(f"{name}: [N={n}, K={k}] per expert is not a whole number of "
                         f"[tile_n={tile_n}, tile_k={tile_k}] tiles (N must be a multiple of {tile_n}, "
                         f"K of {tile_k})")
    return num_experts, (n // tile_n) * (k // tile_k) * tile_n, tile_k


def pack_expert_weights(w: torch.Tensor, tile_n: int, tile_k: int) -> torch.Tensor:
    """[E, N, K] expert weights -> [E, (N/tile_n)*(K/tile_k)*tile_n, tile_k], each [tile_n, tile_k]
    tile one contiguous run, an expert's tiles in (n-tile, k-tile) order: element (n, k) of expert
    e sits at row ((n // tile_n) * (K/tile_k) + k // tile_k) * tile_n + n % tile_n, column
    k % tile_k. Dim 0 stays the expert, so whole experts can still be indexed and moved. One
    new tensor (the caller frees ``w``)."""
    if w.dim() != 3:
        raise ValueError(f"pack_expert_weights: w must be [E, N, K], got shape {tuple(w.shape)}")
    e, n, k = w.shape
    shape = packed_shape(e, n, k, (tile_n, tile_k), "pack_expert_weights")
    tiles = w.reshape(e, n // tile_n, tile_n, k // tile_k, tile_k).permute(0, 1, 3, 2, 4)
    return tiles.contiguous().view(shape)


def unpack_expert_weights(packed: torch.Tensor, n: int, k: int, tile_n: int, tile_k: int) -> torch.Tensor:
    """The inverse of :func:`pack_expert_weights`: [E, (N/tile_n)*(K/tile_k)*tile_n, tile_k] -> [E, N, K]
    (a new contiguous tensor)."""
    e = packed.shape[0]
    expected = packed_shape(e, n, k, (tile_n, tile_k), "unpack_expert_weights")
    if tuple(packed.shape) != expected:
        raise ValueError(f"unpack_expert_weights: [E, N={n}, K={k}] in [{tile_n}, {tile_k}] tiles is "
                         f"packed as {expected}, got shape {tuple(packed.shape)}")
    tiles = packed.reshape(e, n // tile_n, k // tile_k, tile_n, tile_k).permute(0, 1, 3, 2, 4)
    return tiles.reshape(e, n, k)


# Pipelined operand tiles of a program must fit in shared memory (227 KB per block on
# Hopper) with room for the epilogue's layout conversions: float32 tiles (tests) take
# fewer stages than bf16 ones.
_SMEM_BUDGET = 144 * 1024
_TMA_SMEM_BUDGET = 192 * 1024


def _fit_stages(cfg: MoEConfig, elem_bytes: int) -> int:
    per_stage = max(cfg.block_m * cfg.block_k1 + 2 * cfg.block_k1 * cfg.block_n1,
                    cfg.block_m * cfg.block_k2 + cfg.block_k2 * cfg.block_n2) * elem_bytes
    # TMA-loaded 16-bit weight tiles need no register staging: 4 x 48 KB stages compiled and
    # ran at T=4096 on the H200 (the sweep's best).
    budget = _TMA_SMEM_BUDGET if cfg.tma and elem_bytes <= 2 else _SMEM_BUDGET
    return max(1, min(cfg.num_stages, budget // per_stage))


def pick_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
                elem_bytes: int = 2) -> MoEConfig:
    """Tile config by the mean number of pairs per expert (T*K/E).

    <= 4 (decode, T <= 170 at K=6, E=256): weight streaming. 16-row blocks; GEMM1
      tiles of 32 gate + 32 up columns, so one token's 6 experts at I=2048 make
      6 * 64 = 384 programs (about 3 per SM), each streaming 512 KB.
    <= 32: medium batches, 32-row blocks.
    above: 128-row blocks, 128 + 128 GEMM1 columns (T=4096 at K=6, E=256 averages 96 pairs
      per expert), weight tiles by TMA, act in sorted rows, 4 stages (16-bit only: 192 KB of
      shared memory). There the GEMMs are weight-bandwidth bound; H200 sweep
      (scripts/probes/fused_moe_prefill_sweep.py), gate_up + down at T=4096: 3,592 us (83% of
      the copy rate) against 3,846 us for the same tiles with pointer loads and 3 stages;
      at T=2048 (48 pairs per expert) 3,431 us against 4,323 us for 32-row blocks.
    Tiles never exceed the (power-of-2 rounded) problem, so tiny test shapes stay tiny.
    """
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 4:
        cfg = MoEConfig(16, 32, 128, 64, 128, 1, num_warps=4, num_stages=4)
    elif per_expert <= 32:
        cfg = MoEConfig(32, 64, 128, 64, 128, 4, num_warps=4, num_stages=4)
    else:
        cfg = MoEConfig(128, 128, 64, 256, 64, 8, num_warps=8, num_stages=4, tma=True, sorted_act=True)
    return fit_config(cfg, hidden, inter, elem_bytes)


def fit_config(cfg: MoEConfig, hidden: int, inter: int, elem_bytes: int = 2) -> MoEConfig:
    """``cfg`` with its tiles no wider than the (power-of-2 rounded) problem and its stages
    within shared memory."""
    h, i = max(16, triton.next_power_of_2(hidden)), max(16, triton.next_power_of_2(inter))
    cfg = dataclasses.replace(cfg, block_n1=min(cfg.block_n1, i), block_k1=min(cfg.block_k1, h),
                              block_n2=min(cfg.block_n2, h), block_k2=min(cfg.block_k2, i))
    return dataclasses.replace(cfg, num_stages=_fit_stages(cfg, elem_bytes))


# Batch-invariant mode: one config for every T. Any fixed config keeps a pair's bits (its row of
# an M-block is computed independently of the others, the K slots are summed in slot order); the
# choice is speed at both ends. The first config (16-row blocks, the decode config) streamed each
# expert's weights about six times at a 4,096-token prefill: 2.70x the normal mode there. The
# default, 64-row blocks, TMA weight tiles and 8 warps, was the fastest of nine fixed configs at
# V4-Flash widths on an H100 (scripts/probes/batch_invariant_configs.py): 1.08 / 1.02 / 1.01 /
# 1.04x the normal mode's configs at T = 1 / 16 / 64 / 4,096.
FIRST_INVARIANT_CONFIG = MoEConfig(16, 32, 128, 64, 128, 1, num_warps=4, num_stages=4)
ROWS64_INVARIANT_CONFIG = MoEConfig(64, 64, 64, 128, 64, 8, num_warps=4, num_stages=4, tma=True, sorted_act=True)
DEFAULT_INVARIANT_CONFIG = MoEConfig(64, 128, 64, 256, 64, 8, num_warps=8, num_stages=4, tma=True, sorted_act=True)
INVARIANT_CONFIG: MoEConfig | None = None
"""Overrides :data:`DEFAULT_INVARIANT_CONFIG` (benchmarks sweep it); None: the default."""


def invariant_config(hidden: int, inter: int, elem_bytes: int = 2) -> MoEConfig:
    """The batch-invariant mode's config, the same for every T (fitted to the problem's widths)."""
    return fit_config(INVARIANT_CONFIG or DEFAULT_INVARIANT_CONFIG, hidden, inter, elem_bytes)


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the padded length of the sorted pairs, a multiple of ``block_m``: every
    touched expert (at most min(P, E)) pads its run by at most block_m - 1."""
    bound = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, cursor_ptr, out_ptr,
                  num_pairs, num_experts, out_cols, stride_out,
                  BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_COLS: tl.constexpr,
                  PDL: tl.constexpr = False):
    pdl.enter(PDL)
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    if e == num_experts:
        # The last program zeroes the output rows of pairs no expert takes (ids outside
        # [0, E): expert parallelism marks non-local experts -1).
        cols = tl.arange(0, BLOCK_COLS)
        for start in range(0, num_pairs, BLOCK):
            pair = start + offs
            ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=0)
            skip = (pair < num_pairs) & ((ids < 0) | (ids >= num_experts))
            if tl.sum(skip.to(tl.int32), axis=0) > 0:
                rows = out_ptr + pair[:, None].to(tl.int64) * stride_out
                for c in range(0, out_cols, BLOCK_COLS):
                    tl.store(rows + c + cols[None, :], tl.zeros([BLOCK, BLOCK_COLS], tl.float32),
                             mask=skip[:, None] & (c + cols[None, :] < out_cols))
        return
    hits = tl.zeros([BLOCK], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=-1)
        hits += (ids == e).to(tl.int32)
    count = tl.sum(hits, axis=0)
    if count > 0:
        padded = tl.cdiv(count, BLOCK_M) * BLOCK_M
        base = tl.atomic_add(cursor_ptr, padded)
        seen = tl.zeros([], tl.int32)
        for start in range(0, num_pairs, BLOCK):
            pair = start + offs
            hit = (tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1) == e).to(tl.int32)
            rank = seen + tl.cumsum(hit, axis=0) - 1                       # stable: pair order
            tl.store(sorted_ptr + base + rank, pair, mask=hit > 0)
            seen += tl.sum(hit, axis=0)
        pad = count + tl.arange(0, BLOCK_M)
        tl.store(sorted_ptr + base + pad, num_pairs, mask=pad < padded)
        num_blocks = padded // BLOCK_M
        for b in range(0, num_blocks, BLOCK):
            tl.store(block_expert_ptr + base // BLOCK_M + b + offs, e, mask=b + offs < num_blocks)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the P = T*K (token, slot) pairs by expert into ``block_m``-row blocks, on the device.

    topk_ids: [T, K] integer; out: [P, W], whose rows for pairs with ids outside [0, E)
    (taken by no expert) are zeroed. Returns (sorted_pairs [L] int32: pair ids
    p = t*K + k grouped by expert, each expert's run padded to a multiple of block_m
    with P; block_expert [L / block_m] int32: the expert of each block; num_padded [1]
    int32: the used length). L = :func:`max_padded_pairs`; entries past num_padded are
    unspecified.
    """
    pairs = topk_ids.numel()
    if out.dim() != 2 or out.shape[0] != pairs or out.stride(1) != 1:
        raise ValueError(f"moe_align: out must be [P={pairs}, W] with unit column stride, "
                         f"got shape {tuple(out.shape)} strides {out.stride()}")
    length = max_padded_pairs(pairs, num_experts, block_m)
    sorted_pairs = torch.empty(length, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(length // block_m, dtype=torch.int32, device=topk_ids.device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=topk_ids.device)
    if pairs:
        # BLOCK ids per loop step; 1024 keeps a decode batch in one step. Each program walks
        # all pairs twice, one dependent L2 load a step, so prefill takes 4096-id steps over
        # 8 warps (fewer, wider steps: the walk is latency bound, not bandwidth bound).
        block = min(1024, max(16, triton.next_power_of_2(pairs)))
        warps = 4
        if pairs > 4 * 1024:
            block, warps = 4096, 8
        _align_kernel[(num_experts + 1,)](
            topk_ids.reshape(-1), sorted_pairs, block_expert, num_padded, out,
            pairs, num_experts, out.shape[1], out.stride(0),
            BLOCK_M=block_m, BLOCK=block, BLOCK_COLS=max(16, min(64, 4096 // block)), num_warps=warps,
            **pdl.flags(topk_ids.device))
    return sorted_pairs, block_expert, num_padded


@triton.jit
def _tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a 1-D program id, GROUP_M M-blocks at a time along N."""
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _gate_up_tile(
    x, w, act_ptr, sorted_ptr, block_expert_ptr, pid_m, pid_n,
    num_pairs, hidden, inter, limit, stride_x, stride_we, stride_wn, stride_act,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_LIMIT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, SORTED_ACT: tl.constexpr,
    PACKED: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of act. With TMA, ``w`` is a descriptor over the weights as
    [E*2I, H] (PACKED: over the packed rows [E*2I*H/TILE_K, TILE_K], boxes inside one tile);
    otherwise a pointer."""
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)                                      # [BLOCK_M] sorted rows
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)                                       # [BLOCK_N] of I
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x + (pair // TOP_K).to(tl.int64)[:, None] * stride_x + ks[None, :]   # [BLOCK_M, BLOCK_K]
    if PACKED:
        # Tile (n // TILE_N, k // TILE_K) of the expert starts at row (n-tile * k_tiles + k-tile) * TILE_N.
        k_tiles = hidden // TILE_K
        if TMA:                                      # box rows: the gate's and up's at k-tile 0
            g_row = (expert * (2 * inter // TILE_N) + n0 // TILE_N) * k_tiles * TILE_N + n0 % TILE_N
            u_row = ((expert * (2 * inter // TILE_N) + (inter + n0) // TILE_N) * k_tiles * TILE_N
                     + (inter + n0) % TILE_N)
        else:                                        # element offsets in the expert: n part + k part
            w_e = w + expert.to(tl.int64) * stride_we
            g_off = (cols // TILE_N) * (k_tiles * TILE_N * TILE_K) + (cols % TILE_N) * TILE_K
            u_off = ((inter + cols) // TILE_N) * (k_tiles * TILE_N * TILE_K) + ((inter + cols) % TILE_N) * TILE_K
    elif not TMA:
        g_ptrs = w + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
        u_ptrs = g_ptrs + inter * stride_wn                                 # [BLOCK_K, BLOCK_N]
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(tl.cdiv(hidden, BLOCK_K)):
        # Descriptor loads zero-fill past H; their rows past this expert's I (ragged N-tiles)
        # are other weights, feeding only output columns the store masks.
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & (ks[None, :] < hidden - k * BLOCK_K), other=0.0)
        if PACKED and not TMA:
            kk = k * BLOCK_K + ks
            k_off = (kk // TILE_K) * (TILE_N * TILE_K) + kk % TILE_K                # [BLOCK_K]
            g_ptrs = w_e + g_off[None, :] + k_off[:, None]                          # [BLOCK_K, BLOCK_N]
            u_ptrs = w_e + u_off[None, :] + k_off[:, None]
        if TMA and PACKED:                                                  # BLOCK_K == TILE_K
            wg = w.load([g_row + k * TILE_N, 0]).T
            wu = w.load([u_row + k * TILE_N, 0]).T
        elif TMA:
            wg = w.load([expert * 2 * inter + n0, k * BLOCK_K]).T
            wu = w.load([expert * 2 * inter + inter + n0, k * BLOCK_K]).T
        elif EVEN_K:
            wg = tl.load(g_ptrs, mask=col_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            k_ok = ks < hidden - k * BLOCK_K
            wg = tl.load(g_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            wu = tl.load(u_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        gate = tl.dot(a, wg, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, wu, up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        if not (TMA or PACKED):
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    act = gate * tl.sigmoid(gate) * up                                      # silu(gate) * up, float32
    act_rows = rows.to(tl.int64) if SORTED_ACT else pair.to(tl.int64)
    tl.store(act_ptr + act_rows[:, None] * stride_act + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_kernel(
    x, w, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter, num_pid_m, limit,
    stride_x, stride_we, stride_wn, stride_act,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_LIMIT: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, SORTED_ACT: tl.constexpr,
    PACKED: tl.constexpr = False, TILE_N: tl.constexpr = 1, TILE_K: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_pid_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):                         # past the padded total: exit
        _gate_up_tile(x, w, act_ptr, sorted_ptr, block_expert_ptr, pid_m, pid_n,
                      num_pairs, hidden, inter, limit, stride_x, stride_we, stride_wn, stride_act,
                      TOP_K, BLOCK_M, BLOCK_N, BLOCK_K, HAS_LIMIT, EVEN_K, DOT_PRECISION, TMA, SORTED_ACT,
                      PACKED, TILE_N, TILE_K)


@triton.jit
def _down_tile(
    act, w, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, pid_m, pid_n,
    num_pairs, hidden, inter, stride_act, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, SORTED_ACT: tl.constexpr,
    PACKED: tl.constexpr, TILE_N: tl.constexpr, TILE_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of the weighted pair outputs. With TMA, ``w`` is a descriptor
    over the weights as [E*H, I] (PACKED: over the packed rows [E*H*I/TILE_K, TILE_K], boxes inside
    one tile), and ``act`` one over the sorted rows [L, I] when SORTED_ACT."""
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)                                      # [BLOCK_M] sorted rows
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)                                       # [BLOCK_N] of H
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    if not (TMA and SORTED_ACT):
        a_rows = rows.to(tl.int64) if SORTED_ACT else pair.to(tl.int64)
        a_ptrs = act + a_rows[:, None] * stride_act + ks[None, :]            # [BLOCK_M, BLOCK_K]
    if PACKED:
        # Tile (n // TILE_N, k // TILE_K) of the expert starts at row (n-tile * k_tiles + k-tile) * TILE_N.
        k_tiles = inter // TILE_K
        if TMA:                                      # box row at k-tile 0
            b_row = (expert * (hidden // TILE_N) + n0 // TILE_N) * k_tiles * TILE_N + n0 % TILE_N
        else:                                        # element offsets in the expert: n part + k part
            w_e = w + expert.to(tl.int64) * stride_we
            b_off = (cols // TILE_N) * (k_tiles * TILE_N * TILE_K) + (cols % TILE_N) * TILE_K
    elif not TMA:
        b_ptrs = w + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(tl.cdiv(inter, BLOCK_K)):
        if TMA and SORTED_ACT:
            a = act.load([row0, k * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=valid[:, None] & (ks[None, :] < inter - k * BLOCK_K), other=0.0)
        if PACKED and not TMA:
            kk = k * BLOCK_K + ks
            k_off = (kk // TILE_K) * (TILE_N * TILE_K) + kk % TILE_K                # [BLOCK_K]
            b_ptrs = w_e + b_off[None, :] + k_off[:, None]                          # [BLOCK_K, BLOCK_N]
        if TMA and PACKED:                                                  # BLOCK_K == TILE_K
            b = w.load([b_row + k * TILE_N, 0]).T
        elif TMA:
            b = w.load([expert * hidden + n0, k * BLOCK_K]).T
        elif EVEN_K:
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=(ks[:, None] < inter - k * BLOCK_K) & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if not (TMA and SORTED_ACT):
            a_ptrs += BLOCK_K
        if not (TMA or PACKED):
            b_ptrs += BLOCK_K
    out_rows = pair.to(tl.int64)
    weight = tl.load(weights_ptr + out_rows, mask=valid, other=0.0).to(tl.float32)  # [BLOCK_M]
    tl.store(out_ptr + out_rows[:, None] * stride_out + cols[None, :],
             (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act, w, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, hidden, inter, num_pid_m,
    stride_act, stride_we, stride_wn, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, SORTED_ACT: tl.constexpr,
    PACKED: tl.constexpr = False, TILE_N: tl.constexpr = 1, TILE_K: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), num_pid_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M < tl.load(num_padded_ptr):                         # past the padded total: exit
        _down_tile(act, w, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, pid_m, pid_n,
                   num_pairs, hidden, inter, stride_act, stride_we, stride_wn, stride_out,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PRECISION, TMA, SORTED_ACT, PACKED, TILE_N, TILE_K)


@triton.jit
def _sum_slots_kernel(pairs_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                      PDL: tl.constexpr = False):
    """out[t] = sum_k pairs[t*K + k] in float32, rounded once (torch's bf16 sum over K is a
    generic reduction: 5 us for one decode token's [6, 4096])."""
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + k) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 experts (tests, exactness) must not fall back to TF32 tensor cores.
    return "ieee" if dtype == torch.float32 else "tf32"


def _rows_operand(t: torch.Tensor, block: list[int], tma: bool) -> object:
    """A [rows, width] operand read in [BLOCK_M, BLOCK_K] tiles: a TMA descriptor, or the tensor."""
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block) if tma else t


def _weight_operand(w: torch.Tensor, block: list[int], tma: bool, name: str) -> object:
    """[E, N, K] expert weights read in [BLOCK_N, BLOCK_K] tiles: with TMA a descriptor over the
    [E*N, K] view (which needs E's stride to be N rows and 16-byte aligned rows), else the tensor."""
    if not tma:
        return w
    e, n, k = w.shape
    if w.stride(0) != n * w.stride(1) or (w.stride(1) * w.element_size()) % 16 or w.data_ptr() % 16:
        raise ValueError(f"fused_moe: TMA tiles of {name} need its experts stacked as one [E*N, K] "
                         f"matrix with 16-byte aligned rows; got shape {tuple(w.shape)} strides {w.stride()}")
    return TensorDescriptor(w, [e * n, k], [w.stride(1), 1], block)


def _check_packed(w: torch.Tensor, n: int, k: int, tile: tuple[int, int], name: str) -> None:
    """``w`` must hold [E, N, K] experts packed by :func:`pack_expert_weights` in ``tile``, each
    expert's tiles contiguous (the kernels address an expert's elements with int32 offsets)."""
    expected = packed_shape(w.shape[0], n, k, tile, f"fused_moe: {name}")
    if tuple(w.shape) != expected or w.stride(2) != 1 or w.stride(1) != tile[1]:
        raise ValueError(f"fused_moe: packed {name} [E, N={n}, K={k}] in {list(tile)} tiles must have shape "
                         f"{expected} with contiguous experts (pack_expert_weights); got shape "
                         f"{tuple(w.shape)} strides {w.stride()}")
    if n * k >= 2 ** 31:
        raise ValueError(f"fused_moe: packed {name} has N*K = {n * k} elements per expert; the kernels "
                         f"address them with int32 offsets (limit {2 ** 31 - 1})")


def _weight_loads(cfg: MoEConfig, packed: bool, block: tuple[int, int], tile: tuple[int, int],
                  boundary: int, elem_bytes: int) -> tuple[bool, int]:
    """(TMA, num_stages) of one GEMM's weight loads: the config's, except that a TMA box must lie
    inside one tile of packed weights (block_k == tile_k, block_n dividing tile_n and ``boundary``,
    the first row of gate_up's up half); otherwise pointer loads, with the stages that fit them."""
    block_n, block_k = block
    if not (cfg.tma and packed) or (block_k == tile[1] and tile[0] % block_n == 0 and boundary % block_n == 0):
        return cfg.tma, cfg.num_stages
    return False, _fit_stages(dataclasses.replace(cfg, tma=False), elem_bytes)


def moe_gate_up(x: torch.Tensor, gate_up_proj: torch.Tensor, sorted_pairs: torch.Tensor,
                block_expert: torch.Tensor, num_padded: torch.Tensor, top_k: int, swiglu_limit: float,
                cfg: MoEConfig, packed: bool = False) -> torch.Tensor:
    """The first grouped GEMM of :func:`fused_moe` (separate so benchmarks can time it): act =
    silu(min(g, L)) * clamp(u, -L, L) for the sorted pairs. Returns act [P, I] by pair, or
    [L, I] by sorted row with ``cfg.sorted_act`` (rows that hold no pair unwritten).
    ``packed``: gate_up_proj is packed in ``GATE_UP_TILE`` tiles (see :func:`fused_moe`)."""
    t, h = x.shape
    if packed:
        i = gate_up_proj.shape[1] * GATE_UP_TILE[1] // (2 * h)
        _check_packed(gate_up_proj, 2 * i, h, GATE_UP_TILE, "gate_up_proj")
    else:
        i = gate_up_proj.shape[1] // 2
    pairs, length = t * top_k, sorted_pairs.shape[0]
    num_pid_m = block_expert.shape[0]
    act = torch.empty(length if cfg.sorted_act else pairs, i, dtype=x.dtype, device=x.device)
    tma, stages = _weight_loads(cfg, packed, (cfg.block_n1, cfg.block_k1), GATE_UP_TILE, i, x.element_size())
    w = _weight_operand(gate_up_proj, [cfg.block_n1, cfg.block_k1], tma, "gate_up_proj")
    _gate_up_kernel[(num_pid_m * triton.cdiv(i, cfg.block_n1),)](
        x, w, act, sorted_pairs, block_expert, num_padded,
        pairs, h, i, num_pid_m, float(swiglu_limit),
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1,
        GROUP_M=cfg.group_m, HAS_LIMIT=swiglu_limit > 0, EVEN_K=h % cfg.block_k1 == 0,
        DOT_PRECISION=_dot_precision(x.dtype), TMA=tma, SORTED_ACT=cfg.sorted_act,
        PACKED=packed, TILE_N=GATE_UP_TILE[0], TILE_K=GATE_UP_TILE[1],
        num_warps=cfg.num_warps, num_stages=stages, **pdl.flags(x.device))
    return act


def moe_down(act: torch.Tensor, down_proj: torch.Tensor, topk_weights: torch.Tensor,
             sorted_pairs: torch.Tensor, block_expert: torch.Tensor, num_padded: torch.Tensor,
             out: torch.Tensor, cfg: MoEConfig, packed: bool = False) -> None:
    """The second grouped GEMM of :func:`fused_moe` (separate so benchmarks can time it):
    out[p] = w[p] * down_e(act of p), written by pair into out [P, H]; act as
    :func:`moe_gate_up` returns it for the same ``cfg``. ``packed``: down_proj is packed in
    ``DOWN_TILE`` tiles (see :func:`fused_moe`)."""
    pairs, h = out.shape
    i = act.shape[1]
    if packed:
        _check_packed(down_proj, h, i, DOWN_TILE, "down_proj")
    num_pid_m = block_expert.shape[0]
    tma, stages = _weight_loads(cfg, packed, (cfg.block_n2, cfg.block_k2), DOWN_TILE, h, act.element_size())
    a = _rows_operand(act, [cfg.block_m, cfg.block_k2], tma and cfg.sorted_act)
    w = _weight_operand(down_proj, [cfg.block_n2, cfg.block_k2], tma, "down_proj")
    _down_kernel[(num_pid_m * triton.cdiv(h, cfg.block_n2),)](
        a, w, out, topk_weights.contiguous(), sorted_pairs, block_expert, num_padded,
        pairs, h, i, num_pid_m,
        act.stride(0), down_proj.stride(0), down_proj.stride(1), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2,
        GROUP_M=cfg.group_m, EVEN_K=i % cfg.block_k2 == 0, DOT_PRECISION=_dot_precision(act.dtype),
        TMA=tma, SORTED_ACT=cfg.sorted_act, PACKED=packed, TILE_N=DOWN_TILE[0], TILE_K=DOWN_TILE[1],
        num_warps=cfg.num_warps, num_stages=stages, **pdl.flags(act.device))


def check_routing(op: str, t: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  swiglu_limit: float) -> None:
    """The routing operands every MoE kernel takes (``op`` names the caller in the error)."""
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{op}: topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} must both be [T={t}, K]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if swiglu_limit < 0:
        raise ValueError(f"{op}: swiglu_limit={swiglu_limit} must be >= 0 (0: no clamp)")


def fused_moe(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, swiglu_limit: float = 0.0,
              config: MoEConfig | None = None, packed: bool = False, invariant: bool = False) -> torch.Tensor:
    """``sum_k w[t,k] * down_e(silu(min(g, L)) * clamp(u, -L, L))``, (g, u) = gate_up_e(x_t),
    e = ids[t,k], L = swiglu_limit (0: no clamp).

    x: [T, H]; gate_up_proj: [E, 2I, H] (gate rows, then up rows); down_proj: [E, H, I];
    topk_weights: [T, K] (float32); topk_ids: [T, K] integer -> [T, H] in x's dtype.
    ``packed``: both weights are stored as :func:`pack_expert_weights` lays them out, gate_up_proj
    in ``GATE_UP_TILE`` tiles ([E, 2I*H/64, 64]) and down_proj in ``DOWN_TILE`` tiles
    ([E, H*I/64, 64]); the result is bitwise that of the stacked weights under the same config.
    A slot whose id is outside [0, E) (-1: an expert another rank holds) contributes nothing.
    ``config`` overrides :func:`pick_config` (benchmarks sweep it); ``invariant`` (batch-invariant
    mode) takes :func:`invariant_config` for every T: a pair's row is computed independently of
    the others in its M-block and the K slots are summed in slot order, so the config is the only
    thing that could make a token's bits depend on its batch.
    """
    if x.dim() != 2:
        raise ValueError(f"fused_moe: x must be [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    if packed:
        tile_k = GATE_UP_TILE[1]
        if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != tile_k or (gate_up_proj.shape[1] * tile_k) % (2 * h):
            raise ValueError(f"fused_moe: packed gate_up_proj has shape {tuple(gate_up_proj.shape)}, "
                             f"expected [E, 2I*H/{tile_k}, {tile_k}] with H={h} (pack_expert_weights in "
                             f"{list(GATE_UP_TILE)} tiles)")
        e, i = gate_up_proj.shape[0], gate_up_proj.shape[1] * tile_k // (2 * h)
        if down_proj.shape[0] != e:
            raise ValueError(f"fused_moe: packed down_proj holds {down_proj.shape[0]} experts, gate_up_proj {e}")
        # The full layout checks run in moe_gate_up / moe_down.
    else:
        if gate_up_proj.dim() != 3 or gate_up_proj.shape[2] != h or gate_up_proj.shape[1] % 2:
            raise ValueError(f"fused_moe: gate_up_proj has shape {tuple(gate_up_proj.shape)}, "
                             f"expected [E, 2I, H={h}]")
        e, i = gate_up_proj.shape[0], gate_up_proj.shape[1] // 2
        if down_proj.shape != (e, h, i):
            raise ValueError(f"fused_moe: down_proj has shape {tuple(down_proj.shape)}, expected ({e}, {h}, {i})")
    check_routing("fused_moe", t, topk_weights, topk_ids, swiglu_limit)
    if x.dtype != gate_up_proj.dtype or x.dtype != down_proj.dtype:
        raise ValueError(f"fused_moe: x ({x.dtype}), gate_up_proj ({gate_up_proj.dtype}) and "
                         f"down_proj ({down_proj.dtype}) must share a dtype")
    for name, w in (("x", x), ("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if w.stride(-1) != 1:
            raise ValueError(f"fused_moe: {name} must have unit stride in its last dim")
    k = topk_ids.shape[1]
    pairs = t * k
    if pairs == 0:
        return torch.zeros_like(x)
    cfg = config or (invariant_config(h, i, x.element_size()) if invariant
                     else pick_config(t, k, e, h, i, x.element_size()))
    out = torch.empty(pairs, h, dtype=x.dtype, device=x.device)             # [P, H]
    sorted_pairs, block_expert, num_padded = moe_align(topk_ids.contiguous(), e, cfg.block_m, out)
    act = moe_gate_up(x, gate_up_proj, sorted_pairs, block_expert, num_padded, k, swiglu_limit, cfg, packed)
    moe_down(act, down_proj, topk_weights, sorted_pairs, block_expert, num_padded, out, cfg, packed)
    return sum_slots(out, t, k)


def sum_slots(out: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """[T, H]: each token's K weighted expert outputs (``out`` [T*K, H], slot t*K + j) summed
    in slot order."""
    h = out.shape[1]
    combined = torch.empty(t, h, dtype=out.dtype, device=out.device)      # [T, H]
    block_h = min(1024, triton.next_power_of_2(h))
    _sum_slots_kernel[(t, triton.cdiv(h, block_h))](
        out, combined, h, TOP_K=k, BLOCK_H=block_h, num_warps=4, **pdl.flags(out.device))
    return combined
