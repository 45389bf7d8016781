"""Batch-invariant mode: a row's result does not depend on its batch.

Contract: with ``batch_invariant=True`` every op's output row for a token is a function
of that token's inputs and its request's KV cache only, not of how many rows share the
call, their order, or how the prompt was chunked. So a request's tokens and logprobs are
bitwise the same alone, inside any batch, and under any chunk budget, on one device kind
and one software version (other CPUs, GPUs or torch builds may give other, equally
invariant, bits).

Two halves, both switched on by :func:`batch_invariant_mode` around an engine's steps:
aten overrides (torch.library, as batch_invariant_ops does) for the ops model code calls
through torch (every ``nn.Linear``, einsum, the sampler's softmaxes), and the kernel
backend (``kernels/backend.py``), which reads :func:`enabled` and gives our own kernels
one reduction order. Overrides rather than routing in backend.py because the torch ops
are called from everywhere (linears, einsums, norms of third-party-shaped code): a missed
call site would silently break the contract, an override cannot be missed.

The CPU: torch's CPU GEMM picks its blocking by the problem's shape, so
``mm(a[:m], w)`` differs in the last bits from ``mm(a, w)[:m]`` for small ``m``
(measured: m in {1, 2, 3} with one thread, also 5 and 7 with two). The fix replaces aten
ops on the CPU dispatch key while the mode is on:

- ``mm``, ``addmm`` (and ``addmm_``), ``bmm``: one tiled batched product. Batch entries
  and rows go in tiles of ``TILE_ROWS``, columns in tiles of ``KEY_TILE``, and the reduction
  over K in ``KEY_TILE`` slices at absolute offsets added in order (all zero-padded), so
  every output element comes from calls of one shape whatever ``M``, the batch count, or
  the padding of attention-shaped products (K and N set by the batch's longest key list)
  are; ``mm`` goes through the batched form because einsum folds a batch of one into it.
- ``_softmax``, ``_log_softmax``, ``mean.dim``, ``sum.dim_IntList`` over the last
  dimension: the same row tiles, since a reduction may split one long row across threads
  when it is alone (``M = 1``) and not otherwise; the softmaxes also pad rows with -inf to
  a multiple of ``VECTOR_WIDTH`` so a row lengthened by padding keeps its entries' lanes.
- Transcendental unary ops (sigmoid, exp, log, tanh, silu, softplus, gelu, cos, sin, erf,
  log1p, expm1): vector code for most elements, scalar code for those a chunk ends with,
  so an element's bits depend on where it falls; they run on row tiles padded to
  ``VECTOR_WIDTH``. Exactly rounded ops (add, mul, div, sqrt, rsqrt) need nothing.

The originals are reached through the ``.out`` overloads, which are not replaced.
Attention (:func:`paged_attention`) reduces over keys in tiles of ``KEY_TILE`` at
absolute positions, merged in a fixed order, so neither chunk boundaries nor the other
sequences of a decode batch change a query's reduction order.

CUDA: cuBLAS picks its kernel (and split-K) by shape and torch's reductions split a long
row over several CTAs when there are few rows, so the CUDA key's ``mm``, ``addmm``,
``addmm_``, ``bmm``, ``baddbmm``, ``_softmax``, ``_log_softmax``, ``logsumexp``,
``mean.dim`` and ``sum.dim_IntList`` run the Triton kernels of
``kernels/batch_invariant_ops.py`` (one launch config for every M, chosen from the dtype and
the weight's (N, K), never from M; a split-K candidate splits by (N, K) alone and sums in
slice order; reductions over any dims, one program a row). CUDA elementwise kernels compute every element with the
same code wherever it falls, so they need nothing. Our own kernels take fixed configs in
the mode (``kernels/backend.py``): attention through the one prefill kernel with key tiles
at absolute positions for prefill, chunks and decode alike (CUDA graphs included), sparse
attention with one tile config and no split, the MoE, router, FP8/FP4 GEMM and
hyper-connection kernels with the config of one M for every M. What is not covered on CUDA
is refused by :func:`check_supported`.

The replacement is process-wide while registered, so :func:`batch_invariant_mode` holds
it only around an engine's steps (reentrant, counted); other engines and tests in the
same process run the stock kernels between those steps.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator

import torch

# Rows per GEMM / reduction tile. 16 keeps single-row decode cheap (1.3-3x plain at M=1,
# measured) while large M stays within 2x; one size per process, never chosen by M.
TILE_ROWS = 16
# Keys per attention tile; tiles start at absolute positions that are multiples of it.
KEY_TILE = 64
# Elements of the widest CPU vector register (fp32, AVX-512) a padded row is a multiple of.
VECTOR_WIDTH = 16

# Architectures whose CPU forward is covered (every reduction goes through the ops above
# or :func:`paged_attention`) and tested bitwise; others are refused in the mode.
CPU_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                               "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"})
# Architectures whose CUDA forward is covered and GPU-tested (tests/gpu/test_batch_invariant_gpu.py),
# DeepSeek-V3's invariant MLA (layers/mla.py: every token a row of the MLA kernel's unsplit
# config) included: the same list as the CPU's.
CUDA_ARCHITECTURES = CPU_ARCHITECTURES

_lock = threading.Lock()
_depth = 0
_library: torch.library.Library | None = None


def enabled() -> bool:
    """Whether the mode is on now (the ops are replaced)."""
    return _depth > 0


def check_supported(device: torch.device, architecture: str, world_size: int = 1) -> None:
    """Raise unless the mode is built for ``device`` and ``architecture`` (and, on CUDA, a
    single device): the mode never silently runs a path that is not invariant. Speculative
    decoding needs nothing more: a verification step's rows go through the same invariant
    kernels as a prompt chunk's, and greedy and seeded rows are verified by exact match."""
    if device.type == "cpu":
        if architecture not in CPU_ARCHITECTURES:
            raise NotImplementedError(
                f"batch_invariant=True with {architecture}: this model's CPU forward is not made "
                f"batch-invariant yet; supported: {', '.join(sorted(CPU_ARCHITECTURES))}")
        return
    if device.type != "cuda":
        raise NotImplementedError(
            f"batch_invariant=True on {device.type}: the batch-invariant kernels are built for cpu and "
            "cuda only; run with batch_invariant=False")
    if architecture not in CUDA_ARCHITECTURES:
        raise NotImplementedError(
            f"batch_invariant=True on cuda with {architecture}: this model's CUDA forward is not made "
            f"batch-invariant yet; supported: {', '.join(sorted(CUDA_ARCHITECTURES))}")
    from deepinfer import env
    from deepinfer.kernels.backend import triton_available
    if env.kernel_backend() == "torch" or not triton_available():
        raise NotImplementedError(
            "batch_invariant=True on cuda without the Triton kernels (DEEPINFER_KERNEL_BACKEND=torch or "
            "no triton package): the CUDA mode runs the Triton kernels; unset DEEPINFER_KERNEL_BACKEND")
    if world_size > 1:
        raise NotImplementedError(
            f"batch_invariant=True on cuda with {world_size} ranks (tensor/expert/data parallel): the "
            "collectives are not made batch-invariant on cuda; run on one device")


def _row_tiles(x: torch.Tensor) -> torch.Tensor:
    """``x`` [M, ...] zero-padded to a multiple of TILE_ROWS rows."""
    pad = -x.shape[0] % TILE_ROWS
    return x if pad == 0 else torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Through the batched form: a product that is an mm for one sequence (einsum folds a
    # batch of 1) and a bmm for several must give the same bits.
    return _bmm(a[None], b[None])[0]


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
           alpha: float = 1) -> torch.Tensor:
    prod = _mm(a, b)
    if alpha != 1:
        prod = prod * alpha
    return prod + (bias if beta == 1 else bias * beta)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Tiles of TILE_ROWS batch entries x TILE_ROWS rows x KEY_TILE columns, reducing over K
    in KEY_TILE slices added in order: the CPU kernel picks its strategy from the whole call's
    size (batch count included), and attention-shaped products have K and N set by the
    longest sequence of the batch (padding), so only fixed tile shapes and a reduction split
    at absolute offsets keep one entry's bits independent of the rest of the call (zero
    padding adds exact zeros)."""
    batch, m, n = a.shape[0], a.shape[1], b.shape[2]
    a = _pad_to(_pad_to(_pad_to(a, 0, TILE_ROWS), 1, TILE_ROWS), 2, KEY_TILE)      # [B', M', K']
    b = _pad_to(_pad_to(_pad_to(b, 0, TILE_ROWS), 1, KEY_TILE), 2, KEY_TILE)       # [B', K', N']
    dtype = torch.result_type(a, b)
    out = torch.zeros((a.shape[0], a.shape[1], b.shape[2]), dtype=dtype)
    tile = torch.empty((TILE_ROWS, TILE_ROWS, KEY_TILE), dtype=dtype)
    for e in range(0, a.shape[0], TILE_ROWS):
        for i in range(0, a.shape[1], TILE_ROWS):
            for j in range(0, b.shape[2], KEY_TILE):
                acc = out[e:e + TILE_ROWS, i:i + TILE_ROWS, j:j + KEY_TILE]
                for k in range(0, a.shape[2], KEY_TILE):
                    torch.ops.aten.bmm.out(a[e:e + TILE_ROWS, i:i + TILE_ROWS, k:k + KEY_TILE].contiguous(),
                                           b[e:e + TILE_ROWS, k:k + KEY_TILE, j:j + KEY_TILE].contiguous(), out=tile)
                    acc += tile
    return out[:batch, :m, :n]


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to a multiple of ``multiple``."""
    pad = -x.shape[dim] % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _last_dim(x: torch.Tensor, dim: int | list[int] | None) -> bool:
    dims = [dim] if isinstance(dim, int) else list(dim or [])
    return x.dim() >= 1 and len(dims) == 1 and dims[0] % x.dim() == x.dim() - 1


def _rows(x: torch.Tensor, fn, width: int | None) -> torch.Tensor:
    """``fn`` of each TILE_ROWS-row tile of ``x`` viewed as rows of its last dim, ``width``
    outputs per row (None: as many as inputs), reshaped back (leading dims kept)."""
    width = x.shape[-1] if width is None else width
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    flat = _row_tiles(flat)
    outs = [fn(flat[i:i + TILE_ROWS]) for i in range(0, flat.shape[0], TILE_ROWS)]
    out = torch.cat(outs)[:m] if outs else flat.new_empty((0, width))
    return out.reshape(*x.shape[:-1], width)


def _softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    if not _last_dim(x, dim):
        return torch.ops.aten._softmax.out(x, dim, half_to_float, out=_empty_like(x, half_to_float))
    return _rows(_neg_inf_padded(x), lambda t: torch.ops.aten._softmax.out(
        t, -1, half_to_float, out=_empty_like(t, half_to_float)), None)[..., :x.shape[-1]]


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    if not _last_dim(x, dim):
        return torch.ops.aten._log_softmax.out(x, dim, half_to_float, out=_empty_like(x, half_to_float))
    return _rows(_neg_inf_padded(x), lambda t: torch.ops.aten._log_softmax.out(
        t, -1, half_to_float, out=_empty_like(t, half_to_float)), None)[..., :x.shape[-1]]


def _neg_inf_padded(x: torch.Tensor) -> torch.Tensor:
    """x with its last dim padded with -inf to a multiple of VECTOR_WIDTH: a row that grows by
    padding (attention over the batch's longest key list) keeps every real entry in its
    vector lane, and the padding adds exact zeros to the softmax's sum."""
    pad = -x.shape[-1] % VECTOR_WIDTH
    if pad == 0 or not x.is_floating_point():
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], pad), float("-inf"))], dim=-1)


def _empty_like(x: torch.Tensor, half_to_float: bool) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32 if half_to_float else x.dtype)


def _reduce(op, x: torch.Tensor, dim, keepdim: bool, dtype: torch.dtype | None) -> torch.Tensor:
    """``mean`` / ``sum`` over the last dim by row tiles; any other reduction as stock."""
    out_dtype = dtype or (x.dtype if x.is_floating_point() or op is torch.ops.aten.mean.out
                          else torch.int64)
    if not _last_dim(x, dim):
        shape = torch.empty(x.shape, device="meta").sum(dim, keepdim=keepdim).shape
        return op(x, dim, keepdim, dtype=dtype, out=torch.empty(shape, dtype=out_dtype))
    out = _rows(x, lambda t: op(t, [-1], True, dtype=dtype, out=torch.empty((t.shape[0], 1), dtype=out_dtype)), 1)
    return out if keepdim else out.squeeze(-1)


def _mean(x: torch.Tensor, dim, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _reduce(torch.ops.aten.mean.out, x, dim, keepdim, dtype)


def _sum(x: torch.Tensor, dim, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _reduce(torch.ops.aten.sum.IntList_out, x, dim, keepdim, dtype)


def _elementwise(out_op):
    """A transcendental unary op (``out_op``: its ``.out`` overload) on row tiles of the input
    viewed as rows of its last dim, each row padded to a multiple of ``VECTOR_WIDTH``: the CPU
    kernels compute such functions (sigmoid, exp, silu, cos, ...) with vector code except
    for the elements a thread's chunk or the whole tensor ends with, so the bits of one
    element depend on where it falls in the call; in fixed-shape tiles of padded rows every
    element of a row takes the same lanes whatever else is in the call."""
    def fn(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if x.dim() == 0 or x.numel() == 0 or not x.is_floating_point():
            return out_op(x, *args, **kwargs, out=torch.empty_like(x))
        rows = x.reshape(-1, x.shape[-1])
        m, w = rows.shape
        width = -(-w // VECTOR_WIDTH) * VECTOR_WIDTH
        tiles = torch.zeros((-(-m // TILE_ROWS) * TILE_ROWS, width), dtype=x.dtype)
        tiles[:m, :w] = rows
        out = torch.empty_like(tiles)
        for i in range(0, tiles.shape[0], TILE_ROWS):
            out_op(tiles[i:i + TILE_ROWS], *args, **kwargs, out=out[i:i + TILE_ROWS])
        return out[:m, :w].reshape(x.shape)
    return fn


def _elementwise_(op):
    """The in-place form of :func:`_elementwise`."""
    def fn(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return x.copy_(op(x, *args, **kwargs))
    return fn


# Unary ops whose CPU kernels approximate in vector code and compute tails in scalar code.
_TRANSCENDENTAL = ("sigmoid", "exp", "log", "tanh", "silu", "cos", "sin", "erf", "log1p", "expm1")
_TRANSCENDENTAL_OVERRIDES = tuple(
    [(name, _elementwise(getattr(torch.ops.aten, name).out)) for name in _TRANSCENDENTAL]
    + [(name + "_", _elementwise_(_elementwise(getattr(torch.ops.aten, name).out))) for name in _TRANSCENDENTAL]
    + [("softplus", _elementwise(torch.ops.aten.softplus.out)),
       ("gelu", _elementwise(torch.ops.aten.gelu.out))])

def _addmm_(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1, alpha: float = 1) -> torch.Tensor:
    return x.copy_(_addmm(x, a, b, beta=beta, alpha=alpha))


_OVERRIDES = (("mm", _mm), ("addmm", _addmm), ("addmm_", _addmm_), ("bmm", _bmm), ("_softmax", _softmax),
              ("_log_softmax", _log_softmax), ("mean.dim", _mean), ("sum.dim_IntList", _sum),
              *_TRANSCENDENTAL_OVERRIDES)



# -- CUDA: the Triton kernels of kernels/batch_invariant_ops.py --------------------------------------

def _ops():
    # Imported on first use: a CPU-only install never needs Triton for the CPU mode.
    from deepinfer.kernels import batch_invariant_ops
    return batch_invariant_ops


_MATMUL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _stock_product(name: str, *args: torch.Tensor, **kwargs) -> torch.Tensor:
    """The stock CUDA kernel of ``name`` (its ``.out`` overload, which is not replaced), for
    the dtypes the Triton matmul does not take (float64, integers): no model path uses them."""
    shape = getattr(torch.ops.aten, name).default(*(t.to("meta") for t in args), **kwargs).shape
    out = torch.empty(shape, dtype=args[-1].dtype, device=args[-1].device)
    return getattr(torch.ops.aten, name).out(*args, **kwargs, out=out)


def _cuda_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _MATMUL_DTYPES or a.dtype != b.dtype:
        return _stock_product("mm", a, b)
    return _ops().mm(a, b)


def _cuda_bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype not in _MATMUL_DTYPES or a.dtype != b.dtype:
        return _stock_product("bmm", a, b)
    return _ops().bmm(a, b)


def _with_input(x: torch.Tensor, prod: torch.Tensor, beta: float, alpha: float,
                dtype: torch.dtype) -> torch.Tensor:
    """``beta * x + alpha * prod`` in float32 (prod the float32 product), rounded once to
    ``dtype``, as cuBLAS's epilogue adds a bias; beta = 0 ignores x (nan included)."""
    if alpha != 1:
        prod = prod * alpha
    if beta != 0:
        prod = prod + (x.float() if beta == 1 else x.float() * beta)
    return prod.to(dtype)


def _cuda_addmm(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
                alpha: float = 1) -> torch.Tensor:
    if a.dtype not in _MATMUL_DTYPES or a.dtype != b.dtype:
        return _stock_product("addmm", x, a, b, beta=beta, alpha=alpha)
    return _with_input(x, _ops().mm(a, b, torch.float32), beta, alpha, a.dtype)


def _cuda_addmm_(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
                 alpha: float = 1) -> torch.Tensor:
    return x.copy_(_cuda_addmm(x, a, b, beta=beta, alpha=alpha))


def _cuda_baddbmm(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float = 1,
                  alpha: float = 1) -> torch.Tensor:
    if a.dtype not in _MATMUL_DTYPES or a.dtype != b.dtype:
        return _stock_product("baddbmm", x, a, b, beta=beta, alpha=alpha)
    return _with_input(x, _ops().bmm(a, b, torch.float32), beta, alpha, a.dtype)


def _cuda_softmax(log: bool):
    def fn(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
        out_dtype = torch.float32 if half_to_float else x.dtype
        if x.dtype == torch.float64:
            stock = torch.ops.aten._log_softmax.out if log else torch.ops.aten._softmax.out
            return stock(x, dim, half_to_float, out=torch.empty(x.shape, dtype=out_dtype, device=x.device))
        return _ops().softmax(x, dim, log, out_dtype)
    return fn


def _cuda_reduce(op_name: str):
    """``sum.dim_IntList`` / ``mean.dim`` over any dims: floating inputs (but float64) by the
    row kernel; integer and boolean sums, exact in any order, and float64 as stock."""
    stock = torch.ops.aten.sum.IntList_out if op_name == "sum" else torch.ops.aten.mean.out

    def fn(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        ops = _ops()
        out_dtype = dtype or (x.dtype if x.is_floating_point() or op_name == "mean" else torch.int64)
        if x.dim() == 0 or x.dtype == torch.float64 or out_dtype == torch.float64 or not x.is_floating_point():
            shape = torch.empty(x.shape, device="meta").sum(dim, keepdim=keepdim).shape
            return stock(x, dim, keepdim, dtype=dtype, out=torch.empty(shape, dtype=out_dtype, device=x.device))
        return ops.reduce(x, dim, keepdim, ops.SUM if op_name == "sum" else ops.MEAN, out_dtype)
    return fn


def _cuda_logsumexp(x: torch.Tensor, dim, keepdim: bool = False) -> torch.Tensor:
    if x.dim() == 0 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        shape = torch.empty(x.shape, device="meta").sum(dim, keepdim=keepdim).shape
        return torch.ops.aten.logsumexp.out(x, dim, keepdim, out=torch.empty(shape, dtype=x.dtype, device=x.device))
    ops = _ops()
    return ops.reduce(x, dim, keepdim, ops.LOGSUMEXP)


_CUDA_OVERRIDES = (("mm", _cuda_mm), ("addmm", _cuda_addmm), ("addmm_", _cuda_addmm_), ("bmm", _cuda_bmm),
                   ("baddbmm", _cuda_baddbmm), ("_softmax", _cuda_softmax(False)),
                   ("_log_softmax", _cuda_softmax(True)), ("logsumexp", _cuda_logsumexp),
                   ("mean.dim", _cuda_reduce("mean")), ("sum.dim_IntList", _cuda_reduce("sum")))


@contextlib.contextmanager
def batch_invariant_mode() -> Iterator[None]:
    """Replace the CPU and CUDA ops above for the duration (reentrant: the outermost exit
    restores the stock kernels)."""
    global _depth, _library
    with _lock:
        if _depth == 0:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                # "Overriding a previously registered kernel": that is the point.
                warnings.simplefilter("ignore")
                for name, fn in _OVERRIDES:
                    lib.impl(name, fn, "CPU")
                for name, fn in _CUDA_OVERRIDES:
                    lib.impl(name, fn, "CUDA")
            _library = lib
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _library is not None:
                _library._destroy()
                _library = None


def paged_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: list[int], seq_lens: list[int], scale: float,
                    sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`reference.paged_attention` with a reduction order fixed by absolute position:
    prefill, any chunk of it and decode give a query the same bits.

    Keys are read in tiles of KEY_TILE starting at multiples of KEY_TILE; each tile's
    scores and probability-weighted values come from same-shape products, and the tiles'
    sums are added one by one in position order. Tiles a query cannot see add exact
    zeros, so where a chunk's key range starts does not matter."""
    from deepinfer.kernels.reference import gather_kv

    out = torch.empty_like(q)
    hq, hkv = q.shape[1], cache.shape[3]
    for b in range(len(seq_lens)):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        ctx = seq_lens[b]
        first_q = ctx - (e - s)
        start = 0 if sliding_window is None else max(0, first_q - sliding_window + 1)
        lo = start // KEY_TILE * KEY_TILE
        hi = -(-ctx // KEY_TILE) * KEY_TILE
        kv = gather_kv(cache, block_table[b], lo, ctx).float()                     # [ctx-lo, 2, Hkv, D]
        kv = torch.cat([kv, kv.new_zeros((hi - ctx, *kv.shape[1:]))])              # [n*KT, 2, Hkv, D]
        k = kv[:, 0].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)           # [Hq, n*KT, D]
        v = kv[:, 1].repeat_interleave(hq // hkv, dim=1).transpose(0, 1)           # [Hq, n*KT, Dv]
        qh = q[s:e].float().transpose(0, 1).contiguous()                            # [Hq, Tq, D]
        q_pos = torch.arange(first_q, ctx)
        k_pos = torch.arange(lo, hi)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < ctx)
        if sliding_window is not None:
            allowed &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
        tiles = range(0, hi - lo, KEY_TILE)
        scores = [torch.bmm(qh, k[:, t:t + KEY_TILE].transpose(1, 2).contiguous()) * scale for t in tiles]
        scores = [sc.masked_fill(~allowed[None, :, t:t + KEY_TILE], float("-inf"))
                  for sc, t in zip(scores, tiles)]
        # The row max is exact whatever the order, so one max over all tiles is invariant.
        m = torch.stack([sc.amax(dim=-1) for sc in scores]).amax(dim=0)            # [Hq, Tq]
        if sinks is not None:
            m = torch.maximum(m, sinks.float()[:, None])
        total = torch.zeros_like(m)
        acc = torch.zeros((hq, e - s, v.shape[-1]))
        for sc, t in zip(scores, tiles):
            p = torch.exp(sc - m[..., None])
            total = total + p.sum(dim=-1)
            acc = acc + torch.bmm(p, v[:, t:t + KEY_TILE].contiguous())
        if sinks is not None:
            total = total + torch.exp(sinks.float()[:, None] - m)
        out[s:e] = (acc / total[..., None]).transpose(0, 1).to(q.dtype)
    return out
