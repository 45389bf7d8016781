"""MoE routing in one launch per layer: scores, expert selection and weight
normalisation fused, no host synchronisation; references:
:func:`reference.softmax_topk`, :func:`reference.biased_topk`,
:func:`reference.hash_route` and :func:`reference.grouped_topk_sigmoid`.

The router GEMM (``x @ W^T``, float32) stays a torch ``F.linear``; these kernels
take its logits [T, E]. One program routes one token: it holds the token's E
logits in registers, applies the score function and picks the K winners by K
rounds of argmax (K <= 16, so this beats a sort). Selection keys and weights
differ where the reference says so: DeepSeek's bias steers which experts win,
the weights are the unbiased scores. Ties go to the lower expert id; torch.topk
leaves their order unspecified.

Outputs: weights [T, K] float32 and expert ids [T, K] int64, experts in order
of selection (best first; hash routing: the table's order).

Shapes: T tokens, E experts, K experts per token, G expert groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.kernels import pdl

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
# K rounds of argmax over E registers; more would want a sort.
_MAX_TOP_K = 16
# One token's logits sit in one program's registers.
_MAX_EXPERTS = 4096


@triton.jit
def _log1p(y):
    # log(1 + y) accurate for tiny y (Kahan's trick): the rounding error of 1 + y
    # cancels in log(u) / (u - 1). Triton's interpreter has no libdevice log1p.
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _scores(logits, valid, SCORE: tl.constexpr):
    """Router scores of a row of float32 logits; 0 where not ``valid``."""
    if SCORE == "sqrtsoftplus":
        # softplus(x) = max(x, 0) + log1p(exp(-|x|)), exact for large |x| of either sign.
        s = tl.sqrt(tl.maximum(logits, 0.0) + _log1p(tl.exp(-tl.abs(logits))))
    elif SCORE == "sigmoid":
        s = tl.sigmoid(logits)
    else:
        z = tl.where(valid, logits, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=0))
        s = p / tl.sum(p, axis=0)
    return tl.where(valid, s, 0.0)


@triton.jit
def _store_route(weights_ptr, ids_ptr, t, weights, ids, scaling,
                 TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr):
    slots = tl.arange(0, BLOCK_K)
    if RENORMALIZE:
        # Slots past TOP_K hold 0, so the sum is over the K chosen.
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(weights_ptr + t * TOP_K + slots, weights * scaling, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, ids.to(tl.int64), mask=slots < TOP_K)


@triton.jit
def _topk_route_kernel(
    logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, weights_ptr, ids_ptr,
    num_experts, stride_logits, stride_tid2eid, scaling,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, SCORE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASH: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    logits = tl.load(logits_ptr + t * stride_logits + cols, mask=valid, other=0.0).to(tl.float32)
    score = _scores(logits, valid, SCORE)                                  # [BLOCK_E]
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    if HASH:
        token = tl.load(input_ids_ptr + t).to(tl.int64)
        ids = tl.load(tid2eid_ptr + token * stride_tid2eid + slots, mask=slots < TOP_K, other=0)
        ids = ids.to(tl.int32)                                             # [BLOCK_K]
        for k in tl.static_range(TOP_K):
            e = tl.sum(tl.where(slots == k, ids, 0), axis=0)
            weights = tl.where(slots == k, tl.sum(tl.where(cols == e, score, 0.0), axis=0), weights)
    else:
        ids = tl.zeros([BLOCK_K], tl.int32)
        key = score
        if HAS_BIAS:
            key += tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        key = tl.where(valid, key, float("-inf"))
        for k in tl.static_range(TOP_K):
            e = tl.argmax(key, axis=0).to(tl.int32)
            weights = tl.where(slots == k, tl.sum(tl.where(cols == e, score, 0.0), axis=0), weights)
            ids = tl.where(slots == k, e, ids)
            key = tl.where(cols == e, float("-inf"), key)
    _store_route(weights_ptr, ids_ptr, t, weights, ids, scaling, TOP_K, BLOCK_K, RENORMALIZE)


@triton.jit
def _grouped_route_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    num_groups, group_size, stride_logits, scaling,
    TOP_K: tl.constexpr, TOPK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
    BLOCK_K: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_EG)
    valid = (g[:, None] < num_groups) & (j[None, :] < group_size)         # [BLOCK_G, BLOCK_EG]
    expert = g[:, None] * group_size + j[None, :]
    logits = tl.load(logits_ptr + t * stride_logits + expert, mask=valid, other=0.0).to(tl.float32)
    score = tl.where(valid, tl.sigmoid(logits), 0.0)
    biased = score + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    biased = tl.where(valid, biased, float("-inf"))
    # A group ranks by the sum of its two best biased scores.
    best = tl.argmax(biased, axis=1)                                       # [BLOCK_G]
    second = tl.max(tl.where(j[None, :] == best[:, None], float("-inf"), biased), axis=1)
    group_score = tl.where(g < num_groups, tl.max(biased, axis=1) + second, float("-inf"))
    keep = g < 0
    for _ in tl.static_range(TOPK_GROUPS):
        top = tl.argmax(group_score, axis=0)
        keep = keep | (g == top)
        group_score = tl.where(g == top, float("-inf"), group_score)
    key = tl.where(keep[:, None], biased, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for k in tl.static_range(TOP_K):
        # Argmax over the [G, E/G] tile: best group by its row maximum, then the column within it.
        row_best = tl.argmax(key, axis=1)                                  # [BLOCK_G]
        top_g = tl.argmax(tl.max(key, axis=1), axis=0)
        top_j = tl.sum(tl.where(g == top_g, row_best, 0), axis=0)
        hit = (g[:, None] == top_g) & (j[None, :] == top_j)
        weights = tl.where(slots == k, tl.sum(tl.sum(tl.where(hit, score, 0.0), axis=1), axis=0), weights)
        ids = tl.where(slots == k, (top_g * group_size + top_j).to(tl.int32), ids)
        key = tl.where(hit, float("-inf"), key)
    _store_route(weights_ptr, ids_ptr, t, weights, ids, scaling, TOP_K, BLOCK_K, RENORMALIZE)


def _check_logits(name: str, logits: torch.Tensor, top_k: int) -> tuple[int, int]:
    if logits.dim() != 2:
        raise ValueError(f"{name}: router_logits must be [T, E], got shape {tuple(logits.shape)}")
    t, e = logits.shape
    if e > _MAX_EXPERTS:
        raise ValueError(f"{name}: {e} experts exceed the kernel's limit of {_MAX_EXPERTS}")
    if not 1 <= top_k <= min(e, _MAX_TOP_K):
        raise ValueError(f"{name}: top_k={top_k} must be in [1, min(E={e}, {_MAX_TOP_K})]")
    if logits.stride(1) != 1:
        raise ValueError(f"{name}: router_logits must have unit stride along experts")
    return t, e


def _outputs(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = logits.shape[0]
    return (torch.empty(t, top_k, dtype=torch.float32, device=logits.device),
            torch.empty(t, top_k, dtype=torch.int64, device=logits.device))


def _warps(block: int) -> int:
    # One warp holds up to 512 scores at 16 per thread; wider rows spread over more warps.
    return min(8, max(1, block // 512))


def topk_route(logits: torch.Tensor, top_k: int, scoring_func: str, scaling: float,
               renormalize: bool, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts by ``score(logits) + bias``; weights are the unbiased scores (renormalised
    over the K chosen if asked) times ``scaling``.

    logits: [T, E]; bias: [E] or None -> (weights [T, K] float32, ids [T, K] int64).
    """
    if scoring_func not in SCORE_FUNCS:
        raise ValueError(f"topk_route: scoring_func={scoring_func!r}; supported: {', '.join(SCORE_FUNCS)}")
    t, e = _check_logits("topk_route", logits, top_k)
    if bias is not None and bias.shape != (e,):
        raise ValueError(f"topk_route: bias has shape {tuple(bias.shape)}, expected ({e},)")
    weights, ids = _outputs(logits, top_k)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    _topk_route_kernel[(t,)](
        logits, bias.contiguous() if bias is not None else logits, logits, logits, weights, ids,
        e, logits.stride(0), 0, scaling,
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), SCORE=scoring_func,
        HAS_BIAS=bias is not None, HASH=False, RENORMALIZE=renormalize, num_warps=_warps(block_e),
        **pdl.flags(logits.device))
    return weights, ids


def hash_route(logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor,
               scoring_func: str, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``tid2eid[input_ids[t]]``; weights are their scores renormalised, times ``scaling``.

    logits: [T, E]; tid2eid: [V, K] integer; input_ids: [T] -> (weights [T, K] float32, ids [T, K] int64).
    """
    if scoring_func not in SCORE_FUNCS:
        raise ValueError(f"hash_route: scoring_func={scoring_func!r}; supported: {', '.join(SCORE_FUNCS)}")
    if tid2eid.dim() != 2 or tid2eid.stride(1) != 1:
        raise ValueError(f"hash_route: tid2eid must be a [V, K] table with unit stride along K, "
                         f"got shape {tuple(tid2eid.shape)} strides {tid2eid.stride()}")
    top_k = tid2eid.shape[1]
    t, _ = _check_logits("hash_route", logits, top_k)
    if input_ids.shape != (t,):
        raise ValueError(f"hash_route: input_ids has shape {tuple(input_ids.shape)}, expected ({t},)")
    weights, ids = _outputs(logits, top_k)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(logits.shape[1])
    _topk_route_kernel[(t,)](
        logits, logits, tid2eid, input_ids.contiguous(), weights, ids,
        logits.shape[1], logits.stride(0), tid2eid.stride(0), scaling,
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), SCORE=scoring_func,
        HAS_BIAS=False, HASH=True, RENORMALIZE=True, num_warps=_warps(block_e), **pdl.flags(logits.device))
    return weights, ids


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router (Qwen3-MoE): see :func:`reference.softmax_topk`."""
    return topk_route(logits, top_k, "softmax", 1.0, renormalize)


def grouped_topk_sigmoid(logits: torch.Tensor, correction_bias: torch.Tensor, num_groups: int,
                         topk_groups: int, top_k: int, renormalize: bool,
                         scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 group-limited sigmoid routing: see :func:`reference.grouped_topk_sigmoid`."""
    t, e = _check_logits("grouped_topk_sigmoid", logits, top_k)
    if num_groups < 1 or e % num_groups or e // num_groups < 2:
        raise ValueError(f"grouped_topk_sigmoid: E={e} must split into num_groups={num_groups} "
                         "groups of at least 2 experts")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"grouped_topk_sigmoid: topk_groups={topk_groups} must be in [1, {num_groups}]")
    if top_k > topk_groups * (e // num_groups):
        raise ValueError(f"grouped_topk_sigmoid: top_k={top_k} exceeds the "
                         f"{topk_groups * (e // num_groups)} experts of the kept groups")
    if correction_bias.shape != (e,):
        raise ValueError(f"grouped_topk_sigmoid: correction_bias has shape "
                         f"{tuple(correction_bias.shape)}, expected ({e},)")
    weights, ids = _outputs(logits, top_k)
    if t == 0:
        return weights, ids
    block_g, block_eg = triton.next_power_of_2(num_groups), triton.next_power_of_2(e // num_groups)
    _grouped_route_kernel[(t,)](
        logits, correction_bias.contiguous(), weights, ids,
        num_groups, e // num_groups, logits.stride(0), scaling,
        TOP_K=top_k, TOPK_GROUPS=topk_groups, BLOCK_G=block_g, BLOCK_EG=block_eg,
        BLOCK_K=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
        num_warps=_warps(block_g * block_eg), **pdl.flags(logits.device))
    return weights, ids
