"""One interface over the two implementations of each kernel: the pure-PyTorch
references (``reference.py``, any device) and the Triton kernels (CUDA).

Layers call the functions here; each picks its implementation per call from
DEEPINFER_KERNEL_BACKEND (``env.kernel_backend``) and the device of its first
tensor argument. Triton modules are imported only when a Triton kernel is
chosen, so a CPU-only install never needs them; both implementations take the
same arguments and return the same result.

Batch-invariant mode (``batch_invariant.enabled()``): the Triton kernels take a config that
does not depend on the batch (the one of a fixed M, no splits whose count follows T, the
prefill attention kernel for decode too); the references take the CPU mode's invariant
paths. See ``batch_invariant.py``.
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from deepinfer import batch_invariant, env
from deepinfer.kernels import reference


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package imports (the CUDA wheels of torch ship it)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for a call whose first tensor is ``x``."""
    choice = env.kernel_backend()
    if choice == "torch":
        return False
    if choice == "auto":
        return x.is_cuda and triton_available()
    if not triton_available():
        raise RuntimeError("DEEPINFER_KERNEL_BACKEND=triton but the triton package does not import")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(f"DEEPINFER_KERNEL_BACKEND=triton needs CUDA tensors (got {x.device}) or "
                           "TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter")
    return True


# -- activations quantised by the kernel that produced them --------------------------------
# A kernel whose output feeds FP8 linears (a norm, the collapse of a hyper-connection, the shared
# expert's SwiGLU) can store the output's FP8 codes and scales in the same launch; the output
# tensor then carries them (attach_fp8) and an FP8 linear reading that very tensor object with
# the same activation group and scale format skips its act-quant launch (attached_fp8;
# layers/quant_linear.py). The codes are fp8_act_quant's of the output, bit for bit, so the result
# is the same either way. Contract: only a kernel's fresh output carries them, and nothing writes
# that tensor in place afterwards (inference tensors keep no version counter to check). Views and
# reshapes are new tensor objects and carry nothing (their linear quantises as usual). Only the
# Triton paths attach: the references leave the quantisation to the linear.
_FP8 = "_deepinfer_fp8"


def attach_fp8(x: torch.Tensor, group: int, pow2_scale: bool, codes: torch.Tensor, scales: torch.Tensor
               ) -> torch.Tensor:
    """``x`` (a kernel's fresh output [..., K]) carrying its codes [rows, K] e4m3 and scales [rows,
    K/group] float32 (``fp8_act_quant(x.reshape(-1, K), group, pow2_scale)``); returns x."""
    setattr(x, _FP8, (group, pow2_scale, x.data_ptr(), tuple(x.shape), codes, scales))
    return x


def attached_fp8(x: torch.Tensor, group: int, pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The codes and scales :func:`attach_fp8` put on ``x`` for this group and scale format, or None."""
    rec = getattr(x, _FP8, None)
    if rec is None or rec[:4] != (group, pow2_scale, x.data_ptr(), tuple(x.shape)):
        return None
    return rec[4], rec[5]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True,
             fp8: tuple[int, bool] | None = None) -> torch.Tensor:
    """x: [..., D]; weight: [D] -> [..., D] (see :func:`reference.rms_norm`). ``fp8`` = (group,
    pow2_scale): the output feeds FP8 linears; the kernel quantises it in the same launch and
    the output carries the codes (:func:`attach_fp8`)."""
    if use_triton(x):
        from deepinfer.kernels.rms_norm import rms_norm as kernel
        if fp8 is None:
            return kernel(x, weight, eps, round_first)
        out, codes, scales = kernel(x, weight, eps, round_first, fp8=fp8)
        return attach_fp8(out, *fp8, codes, scales)
    return reference.rms_norm(x, weight, eps, round_first)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D/2] float32 -> rotated copy [T, H, D]
    (see :func:`reference.apply_rope`)."""
    if use_triton(x):
        from deepinfer.kernels.rope import apply_rope as kernel
        return kernel(x, cos, sin)
    return reference.apply_rope(x, cos, sin)


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (q [T, Hq, D], k [T, Hk, D]). Consumes its inputs: the Triton kernel
    rotates them in place in one launch, so callers must not read q or k afterwards."""
    if use_triton(q):
        from deepinfer.kernels.rope import apply_rope_qk_ as kernel
        kernel(q, k, cos, sin)
        return q, k
    return reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)


def store_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, *tensors: torch.Tensor) -> None:
    """cache: [NB, bs, nt, Hkv, D]; slot_mapping: [T]; tensors: nt x [T, Hkv, D]
    (see :func:`reference.store_kv`; the Triton kernel skips slots of -1)."""
    if use_triton(cache):
        from deepinfer.kernels.store_kv import store_kv as kernel
        kernel(cache, slot_mapping, *tensors)
        return
    reference.store_kv(cache, slot_mapping, *tensors)


def store_record(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor, fmt: str) -> None:
    """Encode each row of x [T, D] as a ``fmt`` KV record and store it at its slot of the record
    cache [NB, bs, 1, 1, record_bytes(fmt, D)] uint8; slots of -1 store nothing (see
    :func:`reference.store_record`)."""
    if use_triton(cache):
        from deepinfer.kernels.kv_records import store_records as kernel
        kernel(cache, slot_mapping, x, fmt)
        return
    reference.store_record(cache, slot_mapping, x, fmt)


def paged_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                    query_start_loc: list[int], seq_lens: list[int], scale: float,
                    sliding_window: int | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D] over cache [NB, bs, 2, Hkv, D] -> [T, Hq, D] (see :func:`reference.paged_attention`)."""
    if use_triton(q):
        from deepinfer.kernels.paged_attention import paged_attention as kernel
        return kernel(q, cache, block_table, query_start_loc, seq_lens, scale, sliding_window, sinks,
                      invariant=batch_invariant.enabled())
    if batch_invariant.enabled():
        return batch_invariant.paged_attention(q, cache, block_table, query_start_loc, seq_lens, scale,
                                               sliding_window, sinks)
    return reference.paged_attention(q, cache, block_table, query_start_loc, seq_lens, scale,
                                     sliding_window, sinks)


def sparse_attention(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]],
                     sinks: torch.Tensor, scale: float,
                     formats: list[str | None] | None = None) -> torch.Tensor:
    """q: [T, H, D]; sources: (cache [NB, bs, nt, 1, D], slots [T, K]) pairs -> [T, H, D]; a source
    whose ``formats`` entry names a record format is a packed record cache (uint8 rows of
    ``record_bytes(fmt, D)``), read as its values (see :func:`reference.sparse_attention`)."""
    if use_triton(q):
        from deepinfer.kernels.sparse_attention import invariant_config
        from deepinfer.kernels.sparse_attention import sparse_attention as kernel
        config = invariant_config(q) if batch_invariant.enabled() else None
        return kernel(q, sources, sinks, scale, config=config, formats=formats)
    return reference.sparse_attention(q, sources, sinks, scale, formats)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, slots: torch.Tensor,
                 scale: float, topk: int, groups: torch.Tensor | None = None) -> torch.Tensor:
    """[T, min(topk, N)] best candidate slots (see :func:`reference.indexer_topk`). ``groups``
    ([T] int ids, tokens of one id having candidate rows that agree wherever both are >= 0,
    as one sequence's tokens do) lets the Triton kernel load each key once for a block of
    tokens; the result does not depend on it."""
    if use_triton(q) or batch_invariant.enabled():
        return topk_slots(indexer_scores(q, weights, key_cache, slots, scale, groups), slots, topk)
    return reference.indexer_topk(q, weights, key_cache, slots, scale, topk)


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, slots: torch.Tensor,
                   scale: float, groups: torch.Tensor | None = None,
                   key_format: str | None = None) -> torch.Tensor:
    """[T, N] float32 lightning-indexer scores, -inf where the slot is -1 (see
    :func:`reference.indexer_scores`; ``groups`` as in :func:`indexer_topk`; ``key_format``: the
    keys are packed records of that format)."""
    if use_triton(q):
        from deepinfer.kernels.indexer import indexer_scores as kernel
        # Batch-invariant mode: the per-token kernel (token blocks tile the products by how
        # many tokens a sequence brings).
        groups = None if batch_invariant.enabled() else groups
        return kernel(q, weights, key_cache, slots, scale, groups=groups, key_format=key_format)
    return reference.indexer_scores(q, weights, key_cache, slots, scale, key_format)


def topk_slots(scores: torch.Tensor, slots: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, min(topk, N)] slots of each row's ``topk`` best scores, -1 where the score is -inf
    (see :func:`reference.topk_slots`; the Triton path keeps the same set in candidate order,
    which attention does not depend on)."""
    invariant = batch_invariant.enabled()
    if use_triton(scores):
        from deepinfer.kernels.topk import MAX_CANDIDATES
        from deepinfer.kernels.topk import topk_slots as kernel
        if slots.shape[1] <= topk and not invariant:
            # Every candidate is kept (short contexts, decode buckets): no sort.
            return torch.where(scores > float("-inf"), slots, -1)
        if slots.shape[1] <= MAX_CANDIDATES:
            return kernel(scores, slots, topk)
    # Batch-invariant mode: a row's selection and the order attention sums it in must not
    # depend on how many candidates its step padded it to: ties go to the earliest candidate
    # and the kept slots come compacted in candidate order (the kernel's output; the all-kept
    # shortcut above leaves a masked candidate's place empty, so the mode takes the kernel).
    return reference.topk_slots(scores, slots, topk, earliest_ties=invariant, candidate_order=invariant)


def paged_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, max_seq_len: int, scale: float,
                           sliding_window: int | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [B, Hq, D], one query per sequence at position ``seq_lens[b] - 1`` (seq_lens: [B] int32
    on q's device, each <= max_seq_len) over cache [NB, bs, 2, Hkv, D] -> [B, Hq, D]. The Triton
    kernel never synchronises with the host (CUDA-graph safe); the reference reads the lengths
    back (see :func:`reference.paged_decode_attention`)."""
    if use_triton(q):
        if batch_invariant.enabled():
            # The prefill kernel's reduction order: a decode query sums its keys as a chunk's would.
            from deepinfer.kernels.paged_attention import paged_decode_attention_invariant
            return paged_decode_attention_invariant(q, cache, block_table, seq_lens, scale, sliding_window, sinks)
        from deepinfer.kernels.paged_attention import paged_decode_attention as kernel
        return kernel(q, cache, block_table, seq_lens, max_seq_len, scale, sliding_window, sinks)
    if batch_invariant.enabled():
        # One query per sequence: the same absolute-tile reduction as prefill.
        return batch_invariant.paged_attention(q, cache, block_table, list(range(q.shape[0] + 1)),
                                               seq_lens.tolist(), scale, sliding_window, sinks)
    return reference.paged_decode_attention(q, cache, block_table, seq_lens.tolist(), scale,
                                            sliding_window, sinks)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, kv_lora_rank: int, max_seq_len: int) -> torch.Tensor:
    """Absorbed MLA decode: q [B, Nh, R + Dr] over latent cache [NB, bs, 1, 1, R + Dr]
    -> [B, Nh, R] (see :func:`reference.mla_decode`)."""
    if use_triton(q):
        from deepinfer.kernels.mla_decode import invariant_config
        from deepinfer.kernels.mla_decode import mla_decode as kernel
        config = invariant_config(q, kv_lora_rank) if batch_invariant.enabled() else None
        return kernel(q, cache, block_table, seq_lens, scale, kv_lora_rank, max_seq_len, config)
    return reference.mla_decode(q, cache, block_table, seq_lens, scale, kv_lora_rank, max_seq_len)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """MoE router logits: x [T, H], weight [E, H] float32 -> [T, E] float32, x widened in
    registers by the Triton kernels (see :func:`reference.router_logits`)."""
    if use_triton(x):
        from deepinfer.kernels.router import invariant_config
        from deepinfer.kernels.router import router_logits as kernel
        return kernel(x, weight, invariant_config(weight) if batch_invariant.enabled() else None)
    return reference.router_logits(x, weight)


def softmax_topk(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] -> (weights [T, K] float32, ids [T, K] int64)
    (see :func:`reference.softmax_topk`)."""
    if use_triton(router_logits):
        from deepinfer.kernels.moe_routing import softmax_topk as kernel
        return kernel(router_logits, top_k, renormalize)
    return reference.softmax_topk(router_logits, top_k, renormalize)


def biased_topk(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, scoring_func: str,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 routing: router_logits [T, E], bias [E] -> (weights [T, K] float32,
    ids [T, K] int64) (see :func:`reference.biased_topk`)."""
    if use_triton(router_logits):
        from deepinfer.kernels.moe_routing import topk_route as kernel
        return kernel(router_logits, top_k, scoring_func, scaling, renormalize=True, bias=bias)
    return reference.biased_topk(router_logits, bias, top_k, scoring_func, scaling)


def hash_route(router_logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor,
               scoring_func: str, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 hash layers: router_logits [T, E], tid2eid [V, K], input_ids [T] ->
    (weights [T, K] float32, ids [T, K] int64) (see :func:`reference.hash_route`)."""
    if use_triton(router_logits):
        from deepinfer.kernels.moe_routing import hash_route as kernel
        return kernel(router_logits, tid2eid, input_ids, scoring_func, scaling)
    return reference.hash_route(router_logits, tid2eid, input_ids, scoring_func, scaling)


def grouped_topk_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor, num_groups: int,
                         topk_groups: int, top_k: int, renormalize: bool,
                         scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: router_logits [T, E] -> (weights [T, K] float32, ids [T, K] int64)
    (see :func:`reference.grouped_topk_sigmoid`)."""
    if use_triton(router_logits):
        from deepinfer.kernels.moe_routing import grouped_topk_sigmoid as kernel
        return kernel(router_logits, correction_bias, num_groups, topk_groups, top_k, renormalize, scaling)
    return reference.grouped_topk_sigmoid(router_logits, correction_bias, num_groups, topk_groups, top_k,
                                          renormalize, scaling)


def moe_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """Routed SwiGLU experts: x [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I],
    topk_weights / topk_ids [T, K] -> [T, H] (see :func:`reference.moe_experts`). ``packed``: the
    weights are tile-packed for the fused kernel (``fused_moe.pack_expert_weights``)."""
    if use_triton(x):
        from deepinfer.kernels.fused_moe import fused_moe as kernel
        return kernel(x, gate_up_proj, down_proj, topk_weights, topk_ids, packed=packed,
                      invariant=batch_invariant.enabled())
    gate_up_proj, down_proj = _stacked(x, gate_up_proj, down_proj, packed)
    return reference.moe_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids)


def clamped_moe_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        swiglu_limit: float, packed: bool = False) -> torch.Tensor:
    """DeepSeek-V4 routed experts (SwiGLU clamped at swiglu_limit, 0 = no clamp): shapes and
    ``packed`` as :func:`moe_experts` (see :func:`reference.clamped_moe_experts`)."""
    if use_triton(x):
        from deepinfer.kernels.fused_moe import fused_moe as kernel
        return kernel(x, gate_up_proj, down_proj, topk_weights, topk_ids, swiglu_limit, packed=packed,
                      invariant=batch_invariant.enabled())
    gate_up_proj, down_proj = _stacked(x, gate_up_proj, down_proj, packed)
    return reference.clamped_moe_experts(x, gate_up_proj, down_proj, topk_weights, topk_ids, swiglu_limit)


def fp4_moe_experts(x: torch.Tensor, gate_up_q: torch.Tensor, gate_up_s: torch.Tensor, down_q: torch.Tensor,
                    down_s: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    swiglu_limit: float, small_scales: bool = False) -> torch.Tensor:
    """Routed experts over packed FP4 weights (gate_up_q [E, 2I, H/2], down_q [E, H, I/2], scales per
    32 inputs) -> [T, H] (see :func:`reference.fp4_moe_experts`); ``small_scales``: every UE8M0
    scale is at most 2^1 (:meth:`FusedMoE.note_fp4_scales`)."""
    if use_triton(x):
        from deepinfer.kernels.fp4_moe import fp4_moe as kernel
        return kernel(x, gate_up_q, gate_up_s, down_q, down_s, topk_weights, topk_ids, swiglu_limit,
                      invariant=batch_invariant.enabled(), small_scales=small_scales)
    return reference.fp4_moe_experts(x, gate_up_q, gate_up_s, down_q, down_s, topk_weights, topk_ids,
                                     swiglu_limit)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               group: int, pow2_scale: bool, groups: int = 1, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] times an FP8 weight [N, K] with block scales, activations quantised per 1 x ``group``
    -> [..., N]; ``groups`` > 1, a block-diagonal weight: x [..., groups, K] -> [..., groups,
    N / groups] (see :func:`reference.fp8_linear`). Codes and scales that x carries for this group
    (:func:`attach_fp8`) are used instead of quantising x again. ``residual`` [..., N] (ungrouped):
    the product is added to it in place and it is returned (the Triton GEMM adds in its epilogue,
    in float32, rounding once; the reference rounds the product, then adds)."""
    quantized = attached_fp8(x, group, pow2_scale) if groups == 1 else None
    if use_triton(x):
        from deepinfer.kernels.fp8_gemm import fp8_linear as kernel
        return kernel(x, weight, scale, block, group, pow2_scale, invariant=batch_invariant.enabled(),
                      groups=groups, quantized=quantized, residual=residual)
    if quantized is not None:
        out = reference.fp8_block_gemm(*quantized, weight, scale, block, x.dtype).reshape(*x.shape[:-1],
                                                                                          weight.shape[0])
    else:
        out = reference.fp8_linear(x, weight, scale, block, group, pow2_scale, groups)
    return out if residual is None else residual.add_(out)


def _stacked(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
             packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The references read stacked experts: tile-packed weights (packed on CUDA for the Triton
    kernels, then run with the torch backend or moved) are unpacked into a copy per call, correct
    but slow."""
    if not packed:
        return gate_up_proj, down_proj
    from deepinfer.kernels.fused_moe import DOWN_TILE, GATE_UP_TILE, unpack_expert_weights
    h = x.shape[-1]
    i = down_proj.shape[1] * DOWN_TILE[1] // h
    return (unpack_expert_weights(gate_up_proj, 2 * i, h, *GATE_UP_TILE),
            unpack_expert_weights(down_proj, h, i, *DOWN_TILE))


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, fp8: tuple[int, bool] | None = None
                   ) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``, gate/up [T, I] -> [T, I]
    (see :func:`reference.clamped_swiglu`). ``fp8`` as :func:`rms_norm`'s."""
    if use_triton(gate):
        from deepinfer.kernels.activation import clamped_swiglu as kernel
        if fp8 is None:
            return kernel(gate, up, limit)
        out, codes, scales = kernel(gate, up, limit, fp8=fp8)
        return attach_fp8(out, *fp8, codes, scales)
    return reference.clamped_swiglu(gate, up, limit)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float,
           norm: tuple[torch.Tensor, float] | None = None, fp8: tuple[int, bool] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, D] -> (block input [T, D], post [T, n], comb [T, n, n]); with ``norm``
    (weight [D], eps) the block input comes back RMS-normalised, equal bit for bit to
    ``rms_norm(x, weight, eps, round_first=False)`` on the same backend (see :func:`reference.hc_pre`).
    ``fp8`` (with ``norm``) as :func:`rms_norm`'s, for the block input."""
    if use_triton(streams):
        from deepinfer.kernels.hyper_connection import hc_pre as kernel
        out = kernel(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, config=_hc_config(streams.dtype),
                     norm=norm, fp8=fp8)
        if fp8 is not None:
            x, post, comb, codes, scales = out
            return attach_fp8(x, *fp8, codes, scales), post, comb
        return out
    return reference.hc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, norm)


def _hc_config(dtype: torch.dtype):
    """The hyper-connection kernels' config: the launcher's by T, or in batch-invariant mode
    ``hyper_connection.invariant_config`` for every T."""
    if not batch_invariant.enabled():
        return None
    from deepinfer.kernels.hyper_connection import invariant_config
    return invariant_config(dtype)


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """New streams [T, n, D] (see :func:`reference.hc_post`)."""
    if use_triton(streams):
        from deepinfer.kernels.hyper_connection import hc_post as kernel
        return kernel(block_out, streams, post, comb)
    return reference.hc_post(block_out, streams, post, comb)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """streams [T, n, D] -> [T, D] (see :func:`reference.hc_head`)."""
    if use_triton(streams):
        from deepinfer.kernels.hyper_connection import hc_head as kernel
        return kernel(streams, fn, base, scale, hc_eps, norm_eps, config=_hc_config(streams.dtype))
    return reference.hc_head(streams, fn, base, scale, hc_eps, norm_eps)


def sampling_filters_(x: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """min-p, top-k, top-p in place on x [R, V] float32 (see :func:`reference.sampling_filters_`)."""
    if use_triton(x):
        from deepinfer.kernels.sampling import sampling_filters_ as kernel
        kernel(x, min_p, top_k, top_p)
        return
    reference.sampling_filters_(x, min_p, top_k, top_p)


def paged_slots(block_table: torch.Tensor, block_size: int, seq: torch.Tensor, positions: torch.Tensor,
                width: int, ratio: int, sliding: bool) -> torch.Tensor:
    """[T, width] int64 slots of the window tokens (``sliding``) or the compressed entries each
    token sees, -1 for none (see :func:`reference.paged_slots`)."""
    if use_triton(positions):
        from deepinfer.kernels.paged_slots import paged_slots as kernel
        return kernel(block_table, block_size, seq, positions, width, ratio, sliding)
    return reference.paged_slots(block_table, block_size, seq, positions, width, ratio, sliding)


def greedy_sample(logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V'] -> (argmax over the first ``vocab_size`` columns [N] int64, its raw
    logprob [N] float32) (see :func:`reference.greedy_sample`). The Triton kernel reads the
    row once, split over programs, and never synchronises with the host."""
    if use_triton(logits):
        from deepinfer.kernels.greedy import greedy_sample as kernel
        return kernel(logits, vocab_size)
    return reference.greedy_sample(logits, vocab_size)


def compress_entries_(state_cache: torch.Tensor, state_table: torch.Tensor, entry_cache: torch.Tensor,
                      entry_table: torch.Tensor | None, seq: torch.Tensor, pos: torch.Tensor,
                      position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      inv_freq: torch.Tensor, rope_scaling: float, ratio: int, overlap: bool) -> None:
    """DeepSeek-V4 compressor: pool and store the entry of each row [M] whose position
    completes a window (state_cache [NB, bs, 2, 1, C] -> entry_cache [NBe, bse, 1, 1, D], or
    with entry_table None, row m of entry_cache [M, 1, 1, 1, D]; see
    :func:`reference.compress_entries_`). Never synchronises with the host."""
    if use_triton(state_cache):
        from deepinfer.kernels.compressor import compress_entries_ as kernel
        kernel(state_cache, state_table, entry_cache, entry_table, seq, pos, position_bias, norm_weight,
               eps, inv_freq, rope_scaling, ratio, overlap)
        return
    reference.compress_entries_(state_cache, state_table, entry_cache, entry_table, seq, pos, position_bias,
                                norm_weight, eps, inv_freq, rope_scaling, ratio, overlap)


def q_norm_rope(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                eps: float) -> torch.Tensor:
    """DeepSeek-V4 queries: per-head unweighted RMS norm then interleaved rope, q [T, H, D]
    -> [T, H, D] (see :func:`reference.q_norm_rope`)."""
    if use_triton(q):
        from deepinfer.kernels.deepseek_v4_rope import q_norm_rope as kernel
        return kernel(q, positions, inv_freq, scaling, eps)
    return reference.q_norm_rope(q, positions, inv_freq, scaling, eps)


def rope_attention(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, eps: float,
                   sources: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                   scale: float, formats: list[str | None] | None = None) -> torch.Tensor:
    """DeepSeek-V4's attention core: q norm + rope of the raw projection q [T, H, D], sparse
    attention over the sources (``formats``: per source, None or its record format), inverse
    rope of the output -> [T, H, D] (see :func:`reference.rope_attention`)."""
    if use_triton(q):
        from deepinfer.kernels.sparse_attention import invariant_config
        from deepinfer.kernels.sparse_attention import rope_attention as kernel
        config = invariant_config(q) if batch_invariant.enabled() else None
        return kernel(q, positions, inv_freq, scaling, eps, sources, sinks, scale, config, formats)
    return reference.rope_attention(q, positions, inv_freq, scaling, eps, sources, sinks, scale, formats)


def kv_norm_rope(kv: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 scaling: float, eps: float, cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """DeepSeek-V4 kv: float32-weight RMSNorm then interleaved rope, kv [T, D] -> [T, D]; with a
    cache [NB, bs, nt, 1, D] also stored at slot_mapping [T] (see :func:`reference.kv_norm_rope`)."""
    if use_triton(kv):
        from deepinfer.kernels.deepseek_v4_rope import kv_norm_rope as kernel
        return kernel(kv, weight, positions, inv_freq, scaling, eps, cache, slot_mapping)
    return reference.kv_norm_rope(kv, weight, positions, inv_freq, scaling, eps, cache, slot_mapping)


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                     inverse: bool = False) -> torch.Tensor:
    """x [T, H, D] rotated by DeepSeek-V4's interleaved rope (``inverse``: by minus the angle)
    -> [T, H, D]. Consumes x: the Triton kernel rotates it in place, so callers must not read
    x afterwards (see :func:`reference.interleaved_rope`)."""
    if use_triton(x):
        from deepinfer.kernels.deepseek_v4_rope import interleaved_rope_ as kernel
        return kernel(x, positions, inv_freq, scaling, inverse)
    return reference.interleaved_rope(x, positions, inv_freq, scaling, inverse)


def hc_pre_lagged(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  sinkhorn_iters: int, hc_eps: float, norm_eps: float, pre_in: torch.Tensor,
                  norm: tuple[torch.Tensor, float] | None = None, fp8: tuple[int, bool] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, n, D], pre_in [T, n] -> (block input collapsed with pre_in [T, D], the
    connection's own pre, post, comb) (see :func:`reference.hc_pre_lagged`). ``fp8`` as
    :func:`hc_pre`'s."""
    if use_triton(streams):
        from deepinfer.kernels.hyper_connection import hc_pre_lagged as kernel
        out = kernel(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, pre_in,
                     config=_hc_config(streams.dtype), norm=norm, fp8=fp8)
        if fp8 is not None:
            x, pre, post, comb, codes, scales = out
            return attach_fp8(x, *fp8, codes, scales), pre, post, comb
        return out
    return reference.hc_pre_lagged(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, pre_in, norm)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[T, n, D], [T, n] -> [T, D] (see :func:`reference.hc_collapse`); DeepSeek-V4.1's final
    collapse, on the rows the runner samples."""
    return reference.hc_collapse(streams, pre)


def pool_window(state_cache: torch.Tensor, state_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                ratio: int) -> torch.Tensor:
    """DeepSeek-V4.1 ratio-r compressor pooling: [M, D] float32 softmax-gated pool of each
    row's window of states (see :func:`reference.pool_window`). Never synchronises with the host."""
    if use_triton(state_cache):
        from deepinfer.kernels.pool_window import pool_window as kernel
        return kernel(state_cache, state_table, seq, pos, ratio)
    return reference.pool_window(state_cache, state_table, seq, pos, ratio)


def candidate_block_mask(scores: torch.Tensor, visible: torch.Tensor, block: int, num_blocks: int) -> torch.Tensor:
    """DeepSeek-V4.1 candidate blocks: [T, N] bool mask of each row's ``num_blocks`` best runs of
    ``block`` keys, the newest pinned (see :func:`reference.candidate_block_mask`; the Triton
    kernel keeps the earliest runs on a tie at the cut, and never synchronises with the host)."""
    if use_triton(scores):
        from deepinfer.kernels.candidate_blocks import candidate_block_mask as kernel
        return kernel(scores, visible, block, num_blocks)
    return reference.candidate_block_mask(scores, visible, block, num_blocks, earliest_ties=batch_invariant.enabled())


def engram_gate(streams: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek-V4.1 engram gate: streams [T, n, D], kv [T, (n+1)*D], weight [n, D] float32
    -> [T, n, D] (see :func:`reference.engram_gate`)."""
    if use_triton(streams):
        from deepinfer.kernels.engram_gate import engram_gate as kernel
        return kernel(streams, kv, weight, eps)
    return reference.engram_gate(streams, kv, weight, eps)


def engram_gather(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` [T, C] of an FP8 engram table (codes [R, E], scales [R, G]) dequantised on
    the ids' device -> [T, C, E] in ``dtype`` (see :func:`reference.engram_gather`). The backend
    follows the ids: the table may be in pinned host memory, which the Triton kernel reads in
    place (zero-copy) while the reference brings the ids to the host and the rows back."""
    if use_triton(ids):
        from deepinfer.kernels.engram_gather import engram_gather as kernel
        return kernel(codes, scales, ids, dtype)
    return reference.engram_gather(codes, scales, ids, dtype)
