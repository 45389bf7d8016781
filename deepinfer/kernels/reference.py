"""Pure-PyTorch references of every kernel.

These run on any device and define what the Triton kernels must compute.
They favour clarity over speed: loops over sequences are fine here.

Cache layout (one layer): ``[num_blocks, block_size, num_tensors, H_kv, D]``;
tensor 0 is K, tensor 1 is V (a single-tensor cache stores K=V).
"""

from __future__ import annotations

import torch

from deepinfer.kv_spec import DS_MLA_BLOCK, ds_mla_rope, record_bytes, record_value_bytes


def store_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Write new entries: ``cache[slot // bs, slot % bs, i] = tensors[i]`` for each token
    whose slot is not -1.

    cache: [NB, bs, nt, Hkv, D]; slot_mapping: [T] int64; tensors: nt x [T, Hkv, D].
    """
    bs = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks = torch.div(slots, bs, rounding_mode="floor")
    offsets = slots % bs
    for i, t in enumerate(tensors):
        cache[blocks, offsets, i] = t[keep].to(cache.dtype)


def gather_kv(cache: torch.Tensor, block_row: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Entries ``start..end-1`` of one sequence, as ``[end-start, nt, Hkv, D]``."""
    bs = cache.shape[1]
    pos = torch.arange(start, end, device=cache.device)
    blocks = block_row.long()[torch.div(pos, bs, rounding_mode="floor")]
    return cache[blocks, pos % bs]


def causal_attention(
    q: torch.Tensor,               # [Tq, Hq, D]
    k: torch.Tensor,               # [Tk, Hkv, D]
    v: torch.Tensor,               # [Tk, Hkv, Dv]
    q_pos: torch.Tensor,           # [Tq] absolute positions of the queries
    k_pos: torch.Tensor,           # [Tk] absolute positions of the keys
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] learned sink logits
) -> torch.Tensor:                 # [Tq, Hq, Dv]
    """Softmax attention where query i sees key j iff k_pos[j] <= q_pos[i]
    (and q_pos[i] - k_pos[j] < sliding_window). Scores and softmax in float32."""
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    allowed = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.float())
    return out.to(q.dtype)


def paged_attention(
    q: torch.Tensor,               # [T, Hq, D]
    cache: torch.Tensor,           # [NB, bs, 2, Hkv, D]
    block_table: torch.Tensor,     # [B, M]
    query_start_loc: list[int],    # [B+1]
    seq_lens: list[int],           # [B]
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:                 # [T, Hq, D]
    """Attention of each sequence's new queries over its paged cache.

    The new tokens' K/V must already be stored. Sequence b's queries sit at
    positions ``seq_lens[b] - q_len .. seq_lens[b] - 1``; only the keys a query
    can see are gathered, so blocks that left the sliding window are never read.
    """
    out = torch.empty_like(q)
    decodes = [b for b in range(len(seq_lens)) if query_start_loc[b + 1] - query_start_loc[b] == 1]
    if len(decodes) > 1:
        rows = torch.tensor([query_start_loc[b] for b in decodes], device=q.device)
        out[rows] = paged_decode_attention(q[rows], cache, block_table[decodes],
                                           [seq_lens[b] for b in decodes], scale, sliding_window, sinks)
    else:
        decodes = []
    skip = set(decodes)
    for b in range(len(seq_lens)):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s or b in skip:
            continue
        ctx = seq_lens[b]
        first_q = ctx - (e - s)
        start = 0 if sliding_window is None else max(0, first_q - sliding_window + 1)
        kv = gather_kv(cache, block_table[b], start, ctx)
        q_pos = torch.arange(first_q, ctx, device=q.device)
        k_pos = torch.arange(start, ctx, device=q.device)
        out[s:e] = causal_attention(q[s:e], kv[:, 0], kv[:, 1], q_pos, k_pos, scale,
                                    sliding_window, sinks)
    return out


def paged_decode_attention(
    q: torch.Tensor,               # [B, Hq, D] one query per sequence, at position seq_lens[b] - 1
    cache: torch.Tensor,           # [NB, bs, 2, Hkv, D]
    block_table: torch.Tensor,     # [B, M]
    seq_lens: list[int],           # [B]
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:                 # [B, Hq, D]
    """:func:`paged_attention` for a batch of single-token queries, in one batched
    gather and two batched products (keys padded to the longest context, masked)."""
    b, hq, d = q.shape
    bs, hkv = cache.shape[1], cache.shape[3]
    lens = torch.tensor(seq_lens, device=q.device)                          # [B]
    starts = torch.zeros_like(lens) if sliding_window is None else (lens - sliding_window).clamp(min=0)
    span = int((lens - starts).max())
    pos = starts[:, None] + torch.arange(span, device=q.device)[None, :]   # [B, S]
    valid = pos < lens[:, None]
    pos = torch.where(valid, pos, starts[:, None])
    blocks = torch.gather(block_table.long(), 1, torch.div(pos, bs, rounding_mode="floor"))
    kv = cache[blocks, pos % bs].float()                                    # [B, S, 2, Hkv, D]
    qg = q.float().view(b, hkv, hq // hkv, d)                               # [B, Hkv, G, D]
    scores = torch.einsum("bhgd,bshd->bhgs", qg, kv[:, :, 0]) * scale       # [B, Hkv, G, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, hq // hkv, 1).expand(b, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgs,bshd->bhgd", probs, kv[:, :, 1])               # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, round_first: bool = True) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim.

    x: [..., D]; weight: [D]. The normalisation runs in float32 and is cast back
    to x's dtype before the weight multiplies, as in HF Llama/Qwen; with
    ``round_first=False`` (DeepSeek-V4) the weight multiplies in float32 and the
    result is cast to x's dtype once.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if not round_first:
        return (weight.float() * xf).to(x.dtype)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the rotate-half (GPT-NeoX) layout: dims i and i + D/2 form a pair.

    x: [T, H, D]; cos, sin: [T, D/2] float32 (attention scaling already applied).
    The products run in x's dtype, as in HF.
    """
    x1, x2 = x.chunk(2, dim=-1)                                  # [T, H, D/2] each
    c = cos[:, None, :].to(x.dtype)                              # [T, 1, D/2]
    s = sin[:, None, :].to(x.dtype)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def softmax_topk(router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: the top_k experts by probability, optionally renormalised to sum to 1.

    router_logits: [T, E] -> (weights [T, K] float32, expert ids [T, K] int64).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)         # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)              # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Routed SwiGLU experts: ``sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, e = ids[t,k].

    x: [T, H]; gate_up_proj: [E, 2I, H] (gate rows first, then up rows);
    down_proj: [E, H, I]; topk_weights: [T, K]; topk_ids: [T, K] -> [T, H].
    Each expert's output is weighted in x's dtype and summed into a [T, H] buffer.
    """
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)   # [n] tokens routed to e
        gate, up = (x[tok] @ gate_up_proj[e].t()).chunk(2, dim=-1)  # [n, I] each
        h = (torch.nn.functional.silu(gate) * up) @ down_proj[e].t()  # [n, H]
        out.index_add_(0, tok, h * topk_weights[tok, slot, None].to(h.dtype))
    return out


def grouped_topk_sigmoid(
    router_logits: torch.Tensor,   # [T, E]
    correction_bias: torch.Tensor,  # [E]
    num_groups: int,
    topk_groups: int,
    top_k: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 "noaux_tc" routing -> (weights [T, K] float32, expert ids [T, K] int64).

    Scores are ``sigmoid(logits)``; the bias only steers *which* experts win
    (load balancing without an auxiliary loss), the weights are the unbiased
    scores. Experts sit in ``num_groups`` equal groups; a group ranks by the sum
    of its two best biased scores, and only the ``topk_groups`` best groups
    compete for the ``top_k`` experts. Weights are optionally renormalised to
    sum to 1, then multiplied by ``scaling`` (routed_scaling_factor).
    """
    t, e = router_logits.shape
    scores = router_logits.float().sigmoid()                              # [T, E]
    biased = scores + correction_bias.float()                             # [T, E]
    group_scores = biased.view(t, num_groups, e // num_groups).topk(2, dim=-1)[0].sum(-1)  # [T, G]
    group_ids = group_scores.topk(topk_groups, dim=-1, sorted=False)[1]   # [T, topk_groups]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_ids, 1).bool()  # [T, G]
    expert_mask = group_mask.repeat_interleave(e // num_groups, dim=1)    # [T, E]
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1, sorted=False)[1]  # [T, K]
    weights = scores.gather(1, ids)                                       # [T, K]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def masked_sink_attention(
    q: torch.Tensor,               # [Tq, H, D]
    kv: torch.Tensor,              # [Tk, D] one shared vector per key, used as both K and V
    allowed: torch.Tensor,         # [Tq, Tk] bool: key j is visible to query i
    sinks: torch.Tensor,           # [H] learned sink logits
    scale: float,
) -> torch.Tensor:                 # [Tq, H, D]
    """DeepSeek-V4 attention: H query heads over one K=V key set chosen per query
    (sliding window + selected compressed entries), with a sink logit per head that
    takes probability mass but contributes no value. Scores and softmax in float32."""
    scores = torch.matmul(q.transpose(0, 1).float(), kv.float().t()) * scale   # [H, Tq, Tk]
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    sink = sinks.float()[:, None, None].expand(-1, q.shape[0], 1)              # [H, Tq, 1]
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs.to(kv.dtype), kv).transpose(0, 1)


def _slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(valid [..] bool, block [..], offset [..]) of flat slots ``block * bs + offset`` (-1 = none)."""
    bs = cache.shape[1]
    valid = slots >= 0
    s = torch.where(valid, slots.long(), 0)
    return valid, torch.div(s, bs, rounding_mode="floor"), s % bs


def _source_formats(sources: list, formats: list[str | None] | None) -> list[str | None]:
    if formats is None:
        return [None] * len(sources)
    if len(formats) != len(sources):
        raise ValueError(f"formats has {len(formats)} entries for {len(sources)} sources")
    return list(formats)


def _gather_rows(cache: torch.Tensor, slots: torch.Tensor, fmt: str | None,
                 dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid [..] bool, float32 rows [.., dim]) of the entries at flat slots (tensor 0, head 0),
    records decoded; rows without a slot are 0 (garbage, even NaN, at the clamped slot never leaks)."""
    ok, blk, off = _slot_rows(cache, slots)
    rows = cache[blk, off, 0, 0]
    rows = rows.float() if fmt is None else unpack_record(rows, fmt, dim, torch.float32)
    return ok, torch.where(ok[..., None], rows, 0)


def sparse_attention(
    q: torch.Tensor,                                   # [T, H, D]
    sources: list[tuple[torch.Tensor, torch.Tensor]],  # (cache [NB, bs, nt, 1, D or R], slots [T, K_i])
    sinks: torch.Tensor,                               # [H] float32 sink logits
    scale: float,
    formats: list[str | None] | None = None,           # per source: None (values) or its record format
) -> torch.Tensor:                                     # [T, H, D]
    """DeepSeek-V4 attention over keys picked per query token from paged caches.

    Token t sees, for each source, the cache entries at flat slots
    ``slots[t, j] = block * bs + offset`` (-1: no key; tensor 0 of the cache is
    both K and V). Softmax in float32 over every visible key of every source
    plus a per-head sink logit that takes probability mass and adds no value;
    a token with no visible key gets zeros. Slots of one row must be distinct.
    A source with a record format holds packed records (uint8 rows of
    ``record_bytes(fmt, D)``), read as their values (:func:`unpack_record`).
    """
    keys, valid = [], []
    for (cache, slots), fmt in zip(sources, _source_formats(sources, formats)):
        ok, rows = _gather_rows(cache, slots, fmt, q.shape[-1])                 # [T, K_i, D]
        keys.append(rows)
        valid.append(ok)
    kv = torch.cat(keys, dim=1)                                                  # [T, K, D]
    ok = torch.cat(valid, dim=1)                                                 # [T, K]
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) * scale                 # [T, H, K]
    scores = scores.masked_fill(~ok[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(q.shape[0], -1, 1)                # [T, H, 1]
    # The sink first: K grows with the batch's longest row (padding), and a sink after the
    # keys would move within the softmax's vector lanes with it (batch-invariant mode).
    probs = torch.softmax(torch.cat([sink, scores], dim=-1), dim=-1)[..., 1:]
    return torch.einsum("thk,tkd->thd", probs, kv).to(q.dtype)


def indexer_scores(
    q: torch.Tensor,               # [T, Hi, Di] indexer queries
    weights: torch.Tensor,         # [T, Hi] float32 per-head weights
    key_cache: torch.Tensor,       # [NB, bs, nt, 1, Di or R] indexer keys (tensor 0)
    slots: torch.Tensor,           # [T, N] candidate entry slots, -1 = none
    scale: float,
    key_format: str | None = None,  # None (values) or the keys' record format
) -> torch.Tensor:                 # [T, N] float32, -inf where slot is -1
    """Lightning-indexer scores ``sum_h weights[t,h] * relu(q[t,h] . k_s) * scale`` (float32)."""
    ok, keys = _gather_rows(key_cache, slots, key_format, q.shape[-1])           # [T, N, Di]
    dots = torch.relu(torch.einsum("thd,tnd->thn", q.float(), keys)) * scale     # [T, Hi, N]
    scores = (dots * weights.float()[:, :, None]).sum(dim=1)                     # [T, N]
    return scores.masked_fill(~ok, float("-inf"))


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, key_cache: torch.Tensor, slots: torch.Tensor,
    scale: float, topk: int,
) -> torch.Tensor:                 # [T, min(topk, N)] selected slots, -1 where fewer are visible
    """The ``topk`` best candidate slots of each token by :func:`indexer_scores`."""
    return topk_slots(indexer_scores(q, weights, key_cache, slots, scale), slots, topk)


def topk_earliest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` with ties broken by the earliest column (a stable descending sort).
    torch.topk's order among equal values depends on the row's length, so a row padded with
    more trailing -inf columns (a step with later tokens) may keep another of two tied
    candidates; this choice does not."""
    values, idx = x.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], idx[..., :k]


def topk_slots(
    scores: torch.Tensor,          # [T, N] float32, -inf for invisible candidates
    slots: torch.Tensor,           # [T, N] candidate slots
    topk: int,
    earliest_ties: bool = False,
    candidate_order: bool = False,
) -> torch.Tensor:                 # [T, min(topk, N)] by descending score, -1 where fewer are visible
    """The slots of each row's ``topk`` largest scores (torch.topk, ties in its order; with
    ``earliest_ties``, ties broken by the earliest candidate: :func:`topk_earliest`). With
    ``candidate_order`` the kept slots come in candidate order instead, then the -1s: the
    Triton kernel's output (``kernels/topk.py``), whatever the row's padded width."""
    k = min(topk, slots.shape[1])
    best, idx = topk_earliest(scores, k) if earliest_ties else scores.topk(k, dim=-1)
    kept = best > float("-inf")
    if candidate_order:
        order = torch.where(kept, idx, idx + slots.shape[1]).argsort(dim=-1)
        idx, kept = idx.gather(1, order), kept.gather(1, order)
    return torch.where(kept, slots.gather(1, idx), -1)


def mla_decode(
    q: torch.Tensor,               # [B, Nh, R + Dr] absorbed queries: [W_uk^T q_nope, q_pe]
    cache: torch.Tensor,           # [NB, bs, 1, 1, R + Dr] latent entries [c, k_pe]
    block_table: torch.Tensor,     # [B, M]
    seq_lens: torch.Tensor,        # [B] int, each <= max_seq_len; 0 = a padding row
    scale: float,
    kv_lora_rank: int,             # R
    max_seq_len: int,
) -> torch.Tensor:                 # [B, Nh, R] attention output in latent space
    """MLA (DeepSeek-V2/V3) decode in the absorbed form: sequence b's one query, at
    position ``seq_lens[b] - 1``, over its cached latent entries.

    With W_uk / W_uv the key / value halves of kv_b_proj, per head
    ``q_nope . (W_uk c) = (W_uk^T q_nope) . c`` and ``sum_j p_j W_uv c_j = W_uv sum_j p_j c_j``,
    so attention runs over the R + Dr wide entries themselves (one KV "head" shared by
    all Nh heads, values = the first R dims) and the caller applies W_uv to the result.
    Softmax in float32; a padding row (length 0) gets zeros.
    """
    lens = seq_lens.tolist()
    if max(lens, default=0) > max_seq_len:
        raise ValueError(f"mla_decode: seq_lens {lens} exceed max_seq_len={max_seq_len}")
    out = q.new_zeros(q.shape[0], q.shape[1], kv_lora_rank)
    for b, length in enumerate(lens):
        if length == 0:
            continue
        entries = gather_kv(cache, block_table[b], 0, length)[:, 0, 0].float()    # [L, R + Dr]
        probs = torch.softmax(q[b].float() @ entries.t() * scale, dim=-1)        # [Nh, L]
        out[b] = (probs @ entries[:, :kv_lora_rank]).to(q.dtype)
    return out


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """MoE router logits in float32: ``x @ weight.T`` with x widened to float32.

    x: [T, H] (any float dtype); weight: [E, H] -> [T, E] float32.
    """
    return torch.nn.functional.linear(x.float(), weight.float())


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """Per-expert router scores in float32: ``sqrtsoftplus`` (DeepSeek-V4), ``sigmoid`` or ``softmax``.

    logits: [T, E] -> [T, E] float32.
    """
    logits = logits.float()
    if scoring_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return torch.sigmoid(logits)
    if scoring_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"scoring_func={scoring_func!r}; supported: sqrtsoftplus, sigmoid, softmax")


def biased_topk(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scoring_func: str,
                scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 routing: the top_k experts by ``score + bias``; weights are the unbiased
    scores renormalised over the K chosen, times ``scaling`` (routed_scaling_factor).

    logits: [T, E]; bias: [E] -> (weights [T, K] float32, expert ids [T, K] int64).
    """
    scores = router_scores(logits, scoring_func)                            # [T, E]
    ids = torch.topk(scores + bias.float(), top_k, dim=-1, sorted=False).indices  # [T, K]
    weights = scores.gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling, ids


def hash_route(logits: torch.Tensor, tid2eid: torch.Tensor, input_ids: torch.Tensor,
               scoring_func: str, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 hash layers: token t goes to the experts ``tid2eid[input_ids[t]]`` (a frozen
    table); weights are their scores renormalised, times ``scaling``.

    logits: [T, E]; tid2eid: [V, K]; input_ids: [T] -> (weights [T, K] float32, ids [T, K] int64).
    """
    scores = router_scores(logits, scoring_func)                            # [T, E]
    ids = tid2eid[input_ids].long()                                         # [T, K]
    weights = scores.gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scaling, ids


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``; no clamp when ``limit`` is 0."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def clamped_moe_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        swiglu_limit: float) -> torch.Tensor:
    """DeepSeek-V4 routed experts (HF ``DeepseekV4Experts.forward``): :func:`moe_experts` with
    :func:`clamped_swiglu`, and each expert's output multiplied by its float32 weight before
    it is rounded to x's dtype and summed.

    x: [T, H]; gate_up_proj: [E, 2I, H]; down_proj: [E, H, I]; topk_weights, topk_ids: [T, K] -> [T, H].
    """
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():                                       # ascending
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)              # [n] tokens routed to e
        gate, up = (x[tok] @ gate_up_proj[e].t()).chunk(2, dim=-1)           # [n, I] each
        h = clamped_swiglu(gate, up, swiglu_limit) @ down_proj[e].t()         # [n, H]
        out.index_add_(0, tok, (h * topk_weights[tok, slot, None]).to(out.dtype))
    return out


# -- manifold-constrained hyper-connections (DeepSeek-V4 mHC) ----------------------------------------
# Streams [T, n, D]; the mixing weights run in float32 on the RMS-normalised flattened streams.

def _hc_mixes(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``rms_unweighted(flatten(streams)) @ fn.T`` in float32: [T, n, D], fn [M, n*D] -> [T, M]."""
    flat = streams.flatten(1).float()                                            # [T, n*D]
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return torch.nn.functional.linear(flat, fn)


def _hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre_j * streams_j`` in float32, in the streams' dtype: [T, n, D], [T, n] -> [T, D]."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


def hc_mix(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A hyper-connection's three mixings from the streams.

    streams: [T, n, D]; fn: [(2+n)*n, n*D] float32 (rows: n pre, n post, n*n comb);
    base: [(2+n)*n]; scale: [3] (pre, post, comb) -> (pre [T, n], post [T, n],
    comb [T, n, n] doubly stochastic), all float32.
    """
    n = streams.shape[1]
    mixes = _hc_mixes(streams, fn, norm_eps)                                     # [T, (2+n)*n]
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps                          # [T, n]
    post = 2 * torch.sigmoid(post_w * post_s + post_b)                           # [T, n]
    comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + hc_eps
    # Sinkhorn-Knopp: columns first, then (rows, columns) until iters normalisations are done.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``sum_j pre_j * streams_j`` in float32, cast to the streams' dtype: [T, n, D], [T, n] -> [T, D]."""
    return _hc_collapse(streams, pre)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float,
           norm: tuple[torch.Tensor, float] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The "pre" half of a hyper-connection: the block input and the two output mixings.

    streams: [T, n, D]; fn, base, scale as :func:`hc_mix` -> (block input [T, D] in the
    streams' dtype, post [T, n] float32, comb [T, n, n] float32 doubly stochastic).
    ``norm`` (weight [D] float32, eps): the block's input RMSNorm (DeepSeek-V4's, no
    rounding before the weight), applied to the block input before it is returned; the
    plain composition ``rms_norm(x, weight, eps, round_first=False)``, which the kernel fuses.
    """
    pre, post, comb = hc_mix(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    x = _hc_collapse(streams, pre)                                               # [T, D]
    if norm is not None:
        x = rms_norm(x, norm[0], norm[1], round_first=False)
    return x, post, comb


def hc_pre_lagged(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  sinkhorn_iters: int, hc_eps: float, norm_eps: float, pre_in: torch.Tensor,
                  norm: tuple[torch.Tensor, float] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V4.1's lagged connection: the block input is ``collapse(streams, pre_in)``
    (the previous sublayer's pre [T, n] float32), through ``norm`` as in :func:`hc_pre`; the
    connection's own (pre, post, comb) come back for the next sublayer and the expand ->
    (block input [T, D], pre [T, n], post [T, n], comb [T, n, n])."""
    pre, post, comb = hc_mix(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    x = _hc_collapse(streams, pre_in)
    if norm is not None:
        x = rms_norm(x, norm[0], norm[1], round_first=False)
    return x, pre, post, comb


def hc_post(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
            comb: torch.Tensor) -> torch.Tensor:
    """The "post" half: new streams ``post_k * block_out + sum_j comb[j, k] * streams_j`` in float32.

    block_out: [T, D]; streams: [T, n, D]; post: [T, n]; comb: [T, n, n] -> [T, n, D]
    in the streams' dtype.
    """
    out = post.unsqueeze(-1) * block_out.float().unsqueeze(-2) + torch.matmul(
        comb.transpose(-1, -2), streams.float())
    return out.to(streams.dtype)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            hc_eps: float, norm_eps: float) -> torch.Tensor:
    """The model's final collapse ``sum_j (sigmoid(mix_j * scale + base_j) + eps) * streams_j``.

    streams: [T, n, D]; fn: [n, n*D] float32; base: [n]; scale: [1] -> [T, D].
    """
    pre = torch.sigmoid(_hc_mixes(streams, fn, norm_eps) * scale + base) + hc_eps   # [T, n]
    return _hc_collapse(streams, pre)


# -- DeepSeek-V4.1 Engram gate ----------------------------------------------------------------------

def engram_gate(streams: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Engram's gated add: ``s_k + sigmoid(ssqrt(dot_k)) * value`` for each stream k, where
    ``dot_k = sum(s_k * weight_k * key_k) / (rms(s_k) * rms(key_k) * sqrt(D))`` (each rms over
    D values of one stream) and ``ssqrt(x) = sign(x) * sqrt(max(|x|, 1e-6))``, all in float32,
    the result rounded to the streams' dtype once.

    streams: [T, n, D]; kv: [T, (n+1)*D] (n keys stream-major, then the shared value);
    weight: [n, D] float32 (``q_weight * k_weight``) -> [T, n, D].
    """
    n, d = streams.shape[1:]
    key, value = kv.split([n * d, d], dim=-1)
    key = key.float().unflatten(-1, (n, d))                                      # [T, n, D]
    h = streams.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)   # [T, n]
    dot = (h * weight * key).sum(-1) * rstd * d ** -0.5
    # copysign keeps the sign of -0.0, so dot = -0.0 gives sigmoid(-1e-3).
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))   # [T, n]
    return (h + gate[..., None] * value.float()[:, None, :]).to(streams.dtype)


def engram_scale_values(scales: torch.Tensor) -> torch.Tensor:
    """Engram table scales as float32: ``float8_e8m0fnu`` or raw ``uint8`` exponent bytes
    (``2 ** (b - 127)``, the byte 255 NaN as in E8M0), or float32 as is."""
    if scales.dtype == torch.uint8:
        values = torch.exp2(scales.float() - 127.0)
        return values.masked_fill(scales == 255, float("nan"))
    return scales.float()


def engram_gather(codes: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of an FP8 engram table, dequantised: each group of ``E / G`` values of a row
    times its scale, in float32 (exact: an E4M3 value times a power of two), cast to ``dtype``
    once. An id outside ``[0, R)`` gives a zero row (a table shard's convention for rows it
    does not hold).

    codes: [R, E] ``float8_e4m3fn`` (or its bytes as uint8); scales: [R, G] E8M0
    (``float8_e8m0fnu`` or uint8 exponent bytes) or float32; ids: [...] int64/int32
    -> [..., E] in ``dtype`` on the ids' device. The table may sit on another device than the
    ids (a host table): the ids go to the table and the rows come back, a host round trip the
    Triton kernel does not make (it reads the pinned host table in place).
    """
    rows, width = codes.shape
    groups = scales.shape[1]
    valid = (ids >= 0) & (ids < rows)
    idx = torch.where(valid, ids, 0).to(codes.device).long()
    q = codes[idx]
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    values = q.float().unflatten(-1, (groups, width // groups)) * engram_scale_values(scales[idx])[..., None]
    values = values.flatten(-2).to(ids.device)
    return torch.where(valid[..., None], values, 0.0).to(dtype)


# -- sampling filters (min-p, top-k, top-p) ----------------------------------------------------------
# Rows of temperature-scaled logits; a filtered-out token gets -inf. Order: min_p, top_k, top_p.

def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's largest.

    logits: [M, V] float32 (temperature applied); min_p: [M] in [0, 1].
    """
    probs = logits.softmax(-1)                                         # [M, V]
    threshold = probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)      # [M, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties with the k-th are kept).

    logits: [M, V]; k: [M] int64 in [1, V]. Uses ``topk`` up to the largest k,
    not a full sort.
    """
    top = logits.topk(int(k.max()), dim=-1).values                    # [M, kmax] descending
    threshold = top.gather(1, (k - 1).unsqueeze(1))                    # [M, 1] the k-th largest
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability sums to >= ``p``.

    logits: [M, V]; p: [M] in (0, 1]. A token is dropped when the tokens at
    least as unlikely as it (itself included) sum to <= 1 - p, i.e. when the
    strictly more likely tokens already reach p. The most likely token always stays.
    """
    sorted_logits, order = logits.sort(dim=-1)                         # [M, V] ascending
    cum = sorted_logits.softmax(-1).cumsum(-1)                         # [M, V]
    drop = cum <= (1 - p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sampling_filters_(x: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> None:
    """min-p, then top-k, then top-p, in place on the rows where each is on.

    x: [R, V] float32 temperature-scaled logits; min_p: [R] float32 (0 = off);
    top_k: [R] int (>= V = off, else >= 1); top_p: [R] float32 in (0, 1] (1 = off).
    Each filter runs on its own rows only (this picks them with a host sync), so
    a row sees exactly the filters that are on for it.
    """
    v = x.shape[1]
    for fn, arg, on in ((apply_min_p, min_p, min_p > 0), (apply_top_k, top_k.long(), top_k < v),
                        (apply_top_p, top_p, top_p < 1)):
        rows = on.nonzero().squeeze(1)                                 # [M]
        if rows.numel():
            x[rows] = fn(x[rows], arg[rows])


# -- greedy sampling ---------------------------------------------------------------------------------

def greedy_sample(logits: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely token of each row and its raw logprob, in float32.

    logits: [N, V'] (any float dtype) with V' >= vocab_size; columns past ``vocab_size``
    (padding) are ignored -> (token ids [N] int64, logprobs [N] float32). Ties go to the
    lowest index (``torch.argmax``); the logprob is ``x[token] - logsumexp(x)``. A row that
    is -inf throughout gives token 0 and logprob nan (-inf - -inf).
    """
    x = logits[:, :vocab_size].float()                                 # [N, V]
    tokens = x.argmax(-1)                                              # [N]
    logprobs = x.gather(1, tokens.unsqueeze(1)).squeeze(1) - torch.logsumexp(x, dim=-1)
    return tokens, logprobs


def table_slots(table: torch.Tensor, block_size: int, seq: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Flat slots ``table[seq, i // bs] * bs + i % bs`` [M, K] of indices [M, K], -1 where index < 0."""
    i = index.clamp(min=0)
    col = torch.div(i, block_size, rounding_mode="floor").clamp(max=table.shape[1] - 1)
    blocks = table[seq[:, None], col].long()
    return torch.where(index >= 0, blocks * block_size + i % block_size, -1)


def paged_slots(block_table: torch.Tensor, block_size: int, seq: torch.Tensor, positions: torch.Tensor,
                width: int, ratio: int, sliding: bool) -> torch.Tensor:
    """Flat slots of what each token sees in a paged cache, [T, width] int64, -1 for none.

    ``sliding``: column i is the token at ``p + 1 - width + i`` of the token's sequence (the
    window ending at its position p), -1 before position 0. Otherwise column i is compressed
    entry i, visible while ``i < (p + 1) // ratio``. block_table: [B, nb]; seq: [T] sequence
    row of each token; positions: [T].
    """
    p = positions.long()
    cols = torch.arange(width, device=p.device)
    if sliding:
        index = p[:, None] + 1 - width + cols[None, :]                            # [T, W]
    else:
        index = torch.where(cols[None, :] < ((p + 1) // ratio)[:, None], cols[None, :], -1)
    return table_slots(block_table, block_size, seq.long(), index)


def compress_entries_(state_cache: torch.Tensor, state_table: torch.Tensor, entry_cache: torch.Tensor,
                      entry_table: torch.Tensor | None, seq: torch.Tensor, pos: torch.Tensor,
                      position_bias: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      inv_freq: torch.Tensor, rope_scaling: float, ratio: int, overlap: bool) -> None:
    """DeepSeek-V4 compressor: each row at position p with ``(p+1) % r == 0`` stores entry
    ``(p+1)/r - 1`` of its sequence: ``rope(RMSNorm(sum_s softmax_s(gate + bias) * kv), p+1-r)``
    over the states of positions ``p-S+1 .. p`` (S = 2r with overlap: the previous window's
    channels [0, D), then its own window's [D, 2D); else S = r, channels [0, D)). Slots before
    position 0 weigh 0. RoPE: adjacent pairs of the trailing R channels, ``cos/sin((p+1-r) *
    inv_freq) * rope_scaling``.

    state_cache: [NB, bs, 2, 1, C] (kv, raw gate); state_table: [B, nb]; entry_cache:
    [NBe, bse, 1, 1, D]; entry_table: [B, nbe]; seq, pos: [M]; position_bias: [r, C] float32;
    norm_weight: [D] float32; inv_freq: [R/2] float32. Every row is pooled (no host sync);
    rows that complete no window store at slot -1, which the store skips. entry_table None:
    entry_cache is [M, 1, 1, 1, D] and row m's entry goes to its row m.
    """
    r, d = ratio, entry_cache.shape[-1]
    seq, pos = seq.long(), pos.long()
    span = (2 if overlap else 1) * r
    window = pos[:, None] - torch.arange(span - 1, -1, -1, device=pos.device)    # [M, S] p-S+1 .. p
    bs = state_cache.shape[1]
    slots = table_slots(state_table, bs, seq, window)                          # [M, S]
    safe = slots.clamp(min=0)
    states = state_cache[torch.div(safe, bs, rounding_mode="floor"), safe % bs, :, 0]  # [M, S, 2, C]
    kv, gate = states[:, :, 0], states[:, :, 1]
    if overlap:
        kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)                   # [M, 2r, D]
        gate = torch.cat([gate[:, :r, :d] + position_bias[:, :d],
                          gate[:, r:, d:] + position_bias[:, d:]], dim=1)
    else:
        gate = gate + position_bias
    # No window precedes the first: its slots get softmax weight 0.
    valid = (slots >= 0)[..., None]
    kv = torch.where(valid, kv, 0)
    gate = torch.where(valid, gate, float("-inf"))
    weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
    pooled = (kv * weights).sum(dim=1).float()                                  # [M, D]
    pooled = pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + eps)
    pooled = (norm_weight * pooled).to(kv.dtype)
    pooled = interleaved_rope(pooled, pos + 1 - r, inv_freq, rope_scaling)     # [M, D]
    completed = torch.where((pos + 1) % r == 0, (pos + 1) // r - 1, -1)         # [M] entry index
    if entry_table is None:
        slots = torch.where(completed >= 0, torch.arange(pos.shape[0], device=pos.device), -1)
    else:
        slots = table_slots(entry_table, entry_cache.shape[1], seq, completed[:, None])[:, 0]
    store_kv(entry_cache, slots, pooled[:, None])


# -- DeepSeek-V4 interleaved partial RoPE with the q / kv RMS norms ---------------------------------
# The trailing R channels of a head rotate in adjacent pairs (2i, 2i+1) by ``positions * inv_freq[i]``;
# cos and sin are computed in float32 and scaled by the rope's attention scaling (YaRN mscale).
# Shapes: T tokens, H heads, D head dim, R rotary dims (R/2 = inv_freq's length).

def interleaved_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                        scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> (cos, sin) [T, R/2] float32, each times ``scaling``."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    return freqs.cos() * scaling, freqs.sin() * scaling


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing R channels of ``x`` in adjacent pairs (2i, 2i+1), in float32,
    cast back to x's dtype. x: [T, D] or [T, H, D]; cos, sin: [T, R/2]. ``-sin`` inverts."""
    cos = cos.repeat_interleave(2, dim=-1)                                # [T, R]
    sin = sin.repeat_interleave(2, dim=-1)
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    rot = cos.shape[-1]
    nope, rope = x[..., :-rot], x[..., -rot:].float()
    rotated = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope * cos + rotated * sin).to(x.dtype)], dim=-1)


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                     inverse: bool = False) -> torch.Tensor:
    """x: [T, H, D] rotated at ``positions`` [T] (``inverse``: by minus the angle) -> [T, H, D]."""
    cos, sin = interleaved_cos_sin(positions, inv_freq, scaling)
    return apply_interleaved_rope(x, cos, -sin if inverse else sin)


def q_norm_rope(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                eps: float) -> torch.Tensor:
    """Per-head unweighted RMS norm (the factor computed in float32 and applied in q's dtype),
    then the rope. q: [T, H, D] -> [T, H, D]."""
    q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + eps).to(q.dtype)
    return interleaved_rope(q, positions, inv_freq, scaling)


def rope_attention(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, eps: float,
                   sources: list[tuple[torch.Tensor, torch.Tensor]], sinks: torch.Tensor,
                   scale: float, formats: list[str | None] | None = None) -> torch.Tensor:
    """DeepSeek-V4's attention core from the raw query projection q [T, H, D]: the per-head
    q norm and rope (:func:`q_norm_rope`), :func:`sparse_attention` over the sources (``formats``:
    per source, None or its record format), then the output rotated back by minus the angle
    (V carries the rope on its trailing channels)."""
    out = sparse_attention(q_norm_rope(q, positions, inv_freq, scaling, eps), sources, sinks, scale, formats)
    return interleaved_rope(out, positions, inv_freq, scaling, inverse=True)


def kv_norm_rope(kv: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 scaling: float, eps: float, cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """V4 RMSNorm (``weight * x / rms`` in float32, cast back to kv's dtype), then the rope;
    with a cache, also :func:`store_kv` of the result at ``slot_mapping`` (-1 skipped).

    kv: [T, D]; weight: [D] float32; cache: [NB, bs, 1, 1, D]; slot_mapping: [T] -> [T, D].
    """
    xf = kv.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = interleaved_rope((weight * xf).to(kv.dtype)[:, None], positions, inv_freq, scaling)[:, 0]
    if cache is not None:
        store_kv(cache, slot_mapping, out[:, None])
    return out


# -- DeepSeek-V4.1 compressed KV: pair pooling and candidate blocks ----------------------------------

def pool_window(state_cache: torch.Tensor, state_table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor,
                ratio: int) -> torch.Tensor:
    """DeepSeek-V4.1's ratio-r compressor pooling (no position bias, no overlap): for each row at
    position p, ``sum_s softmax_s(gate_s) * kv_s`` per channel over the states of positions
    ``p-r+1 .. p`` (slots before position 0 weigh 0), in float32.

    state_cache: [NB, bs, 2, 1, D] (kv, raw gate per token); state_table: [B, nb]; seq, pos: [M]
    -> [M, D] float32. Only rows with ``(p+1) % r == 0`` complete a window; the caller decides
    which rows it stores.
    """
    seq, pos = seq.long(), pos.long()
    window = pos[:, None] - torch.arange(ratio - 1, -1, -1, device=pos.device)   # [M, r] p-r+1 .. p
    bs = state_cache.shape[1]
    slots = table_slots(state_table, bs, seq, window)                          # [M, r]
    safe = slots.clamp(min=0)
    states = state_cache[torch.div(safe, bs, rounding_mode="floor"), safe % bs, :, 0].float()  # [M, r, 2, D]
    valid = (slots >= 0)[..., None]
    kv = torch.where(valid, states[:, :, 0], 0)
    gate = torch.where(valid, states[:, :, 1], float("-inf"))
    return (kv * gate.softmax(dim=1)).sum(dim=1)


def candidate_block_mask(scores: torch.Tensor, visible: torch.Tensor, block: int, num_blocks: int,
                         earliest_ties: bool = False) -> torch.Tensor:
    """DeepSeek-V4.1's candidate blocks: each row's keys in runs of ``block``, a run scored by
    its best key, the run holding the newest visible key always kept, and the ``num_blocks``
    best runs with a visible key allowed (``earliest_ties``: the earliest runs on a tie at the
    cut, as the Triton kernel keeps them; else torch.topk's order).

    scores: [T, N] float32 index scores (-inf for invisible keys); visible: [T] visible key
    count (keys ``0 .. visible-1``) -> [T, N] bool candidate mask.
    """
    t, n = scores.shape
    pad = (-n) % block
    padded = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
    block_scores = padded.view(t, -1, block).amax(dim=-1)                       # [T, NB]
    nb = block_scores.shape[1]
    newest = torch.where(visible > 0, (visible - 1) // block, -1)               # [T]
    block_scores = torch.where(torch.arange(nb, device=scores.device)[None, :] == newest[:, None],
                               float("inf"), block_scores)
    k = min(num_blocks, nb)
    best, chosen = topk_earliest(block_scores, k) if earliest_ties else block_scores.topk(k, dim=-1)
    keep = torch.zeros(t, nb, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, chosen, best > float("-inf"))
    return keep.repeat_interleave(block, dim=1)[:, :n]


# -- DeepSeek-V4.1 KV-cache formats -------------------------------------------------------------------
# The rounding mlx-lm 0.32.2 applies to V4.1's caches (mlx_lm/models/deepseek_v41.py: _fake_quant_fp8,
# _fake_quant_fp4), bit for bit, and the packed records that hold exactly the rounded values. A row
# [..., C] splits into blocks of contiguous channels with one scale each. Everything runs in float32 and
# the result is cast to the input's dtype; rounded values fit bfloat16 exactly, so a bfloat16 row gives
# ``round(x.float()).bfloat16()`` with no second rounding (float16 can overflow or lose subnormals).
# NaN and infinite inputs are outside the contract. Where mlx-lm applies them (whole rows, the RoPE
# channels included, after RoPE):
#   window KV rows [512]           MXFP8  E4M3, a power-of-two scale per 32   512 + 16 = 528 B a row
#   compressed entries [512]       NVFP4  E2M1, an E4M3 scale per 16          256 + 32 = 288 B a row
#   indexer keys [128] and queries MXFP4  E2M1, a power-of-two scale per 32    64 +  4 =  68 B a key
#     (each 128-channel head)
# Power-of-two scales are stored as E8M0 bytes (biased exponent e + 127, scale 2 ** (byte - 127)); E2M1
# codes are 4 bits, sign in bit 3 and the magnitude's index into _E2M1_VALUES in bits 0-2, packed two a
# byte, the even channel in the low nibble.

_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)   # magnitude of the E2M1 codes 0..7


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., C] -> float32 [..., C/block, block]; C must be a multiple of ``block``."""
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"the last dim must be a multiple of {block}, got shape {tuple(x.shape)}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _pow2_exponent(amax: torch.Tensor, top: float) -> torch.Tensor:
    """E8M0 byte (uint8, ``127 + e``) of the block scale ``2 ** e``, ``e = ceil(log2(amax / top))``.

    As mlx-lm computes it: ``amax / top`` divided in float32, its log2 rounded to float32, then the
    ceiling. The float32 rounding matters: a quotient a few ulps above ``2 ** k`` has a log2 that
    rounds to exactly k (none for -4 <= k <= 3, one ulp at k = 4, about |k| / 5 ulps beyond), so
    the scale stays ``2 ** k`` and the block's largest value clips to ``top``. The log2 runs in
    float64 and is rounded once to float32, i.e. correctly rounded; its ceiling equals that of
    mlx's CPU log2 (glibc's log2f) on every positive normal float32 (checked exhaustively).
    amax: float32 [..., 1], positive normal; e lies in [-126, 126] for the callers' floors.
    """
    exponent = torch.ceil(torch.log2((amax / top).double()).float())
    return (exponent + 127).to(torch.uint8)


def _e8m0_scale(exps: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes in [1, 254] -> float32 ``2 ** (byte - 127)``, built from its bits (exact)."""
    return (exps.to(torch.int32) << 23).view(torch.float32)


def e2m1_codes(q: torch.Tensor, negative_zero: bool = True) -> torch.Tensor:
    """float32 q in [-6, 6] -> uint8 E2M1 codes (same shape), rounding to nearest, ties to even.

    mlx-lm's thresholds: a tie rounds to the even code (in values: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). mlx-lm multiplies by ``sign(q)``: a negative q that rounds to zero
    gives -0 (sign bit set), while a zero q (+0 or -0) gives +0. ``negative_zero=False`` stores
    every zero as +0 (code 0), as weight quantisers do.
    """
    mag = q.abs()
    index = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for threshold in (0.25, 1.25, 2.5, 5.0):
        index += mag > threshold
    for threshold in (0.75, 1.75, 3.5):
        index += mag >= threshold
    negative = q < 0 if negative_zero else (q < 0) & (index > 0)
    return index | (negative.to(torch.uint8) << 3)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes -> their float32 values (code 8 is -0)."""
    # Computed, not looked up in a table: a table built per call is a host -> device copy,
    # which a CUDA-graph capture refuses. Codes 0, 1 are 0 and 0.5; code i >= 2 is
    # 2 ** ((i >> 1) - 1) * (1 + (i & 1) / 2), i.e. _E2M1_VALUES.
    i = (codes & 7).to(torch.int32)
    normal = torch.exp2(((i >> 1) - 1).float()) * (1 + (i & 1).float() / 2)
    mag = torch.where(i < 2, i.float() * 0.5, normal)
    return torch.where(codes >= 8, -mag, mag)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit codes [..., C] -> uint8 [..., C/2], channel 2i in the low nibble of byte i."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., C/2] -> uint8 4-bit codes [..., C] (inverse of :func:`_pack_nibbles`)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _encode_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (E4M3 bytes [..., C/32, 32], E8M0 bytes [..., C/32, 1]), both uint8."""
    blocks = _blocks(x, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)      # an all-zero block gets 2 ** -22
    exps = _pow2_exponent(amax, 448.0)
    q = (blocks / _e8m0_scale(exps)).clamp(-448.0, 448.0)
    # torch's cast rounds to nearest even like mlx's to_fp8 (the same bytes for every float32 in [-448, 448]).
    return q.to(torch.float8_e4m3fn).view(torch.uint8), exps


def _decode_mxfp8(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """(E4M3 bytes [..., N, 32], E8M0 bytes [..., N, 1]) -> float32 [..., N, 32]."""
    return codes.view(torch.float8_e4m3fn).float() * _e8m0_scale(exps)


def _encode_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (E2M1 codes [..., C/16, 16], E4M3 scale bytes [..., C/16, 1]), both uint8."""
    blocks = _blocks(x, 16)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(6.0 * 2.0**-9)   # scale >= 2 ** -9
    # mlx's E4M3 cast saturates to 448; the clamp does so whether or not torch's cast saturates.
    scale_bytes = (amax / 6.0).clamp_max(448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    scale = scale_bytes.view(torch.float8_e4m3fn).float()
    return e2m1_codes((blocks / scale).clamp(-6.0, 6.0)), scale_bytes


def _decode_nvfp4(codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """(E2M1 codes [..., N, 16], E4M3 scale bytes [..., N, 1]) -> float32 [..., N, 16]."""
    return _e2m1_values(codes) * scale_bytes.view(torch.float8_e4m3fn).float()


def _encode_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (E2M1 codes [..., C/32, 32], E8M0 bytes [..., C/32, 1]), both uint8."""
    blocks = _blocks(x, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(6.0 * 2.0**-126)   # scale >= 2 ** -126
    exps = _pow2_exponent(amax, 6.0)
    return e2m1_codes((blocks / _e8m0_scale(exps)).clamp(-6.0, 6.0)), exps


def _decode_mxfp4(codes: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """(E2M1 codes [..., N, 32], E8M0 bytes [..., N, 1]) -> float32 [..., N, 32]."""
    return _e2m1_values(codes) * _e8m0_scale(exps)


def round_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] (C % 32 == 0) rounded to MXFP8, as mlx-lm's ``_fake_quant_fp8`` -> x's shape and dtype.

    Each block of 32 channels gets the scale ``2 ** ceil(log2(max(amax, 1e-4) / 448))`` (see
    :func:`_pow2_exponent`); x / scale is clipped to [-448, 448], rounded to E4M3 to nearest, ties to
    even (signed zeros kept), and multiplied back by the scale.
    """
    codes, exps = _encode_mxfp8(x)
    return _decode_mxfp8(codes, exps).reshape(x.shape).to(x.dtype)


def round_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] (C % 16 == 0) rounded to NVFP4, as mlx-lm's ``_fake_quant_fp4(x, block_size=16,
    e4m3_scale=True)`` -> x's shape and dtype.

    Each block of 16 channels gets the scale ``E4M3(max(amax, 6 * 2 ** -9) / 6)``: the quotient is
    rounded to E4M3 to nearest even, saturating at 448, so the scale is not always above amax / 6 and
    x / scale is clipped to [-6, 6] before rounding to E2M1 (:func:`e2m1_codes`). No global scale.
    Not idempotent for 9 * 2 ** -9 <= amax <= 10 * 2 ** -9: the subnormal scale rounds up to 2 ** -8,
    amax rounds to 2 ** -6, whose own scale is 2 ** -9, so a second rounding clips it to 6 * 2 ** -9.
    """
    codes, scale_bytes = _encode_nvfp4(x)
    return _decode_nvfp4(codes, scale_bytes).reshape(x.shape).to(x.dtype)


def round_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] (C % 32 == 0) rounded to MXFP4, as mlx-lm's ``_fake_quant_fp4(x, block_size=32)``
    -> x's shape and dtype.

    Each block of 32 channels gets the scale ``2 ** ceil(log2(max(amax, 6 * 2 ** -126) / 6))`` (see
    :func:`_pow2_exponent`); x / scale is clipped to [-6, 6] and rounded to E2M1 (:func:`e2m1_codes`).
    """
    codes, exps = _encode_mxfp4(x)
    return _decode_mxfp4(codes, exps).reshape(x.shape).to(x.dtype)


def pack_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (E4M3 bytes [..., C], E8M0 scale bytes [..., C/32]), uint8; unpacks to
    :func:`round_mxfp8` (x) exactly. A 512-channel row takes 512 + 16 = 528 bytes."""
    codes, exps = _encode_mxfp8(x)
    return codes.reshape(x.shape), exps.reshape(*x.shape[:-1], -1)


def unpack_mxfp8(codes: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(E4M3 bytes [..., C], E8M0 bytes [..., C/32]) from :func:`pack_mxfp8` -> [..., C] in ``dtype``."""
    blocks = codes.reshape(*exps.shape, 32)
    return _decode_mxfp8(blocks, exps[..., None]).reshape(codes.shape).to(dtype)


def pack_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (E2M1 codes two a byte [..., C/2], E4M3 scale bytes [..., C/16]), uint8; unpacks
    to :func:`round_nvfp4` (x) exactly. A 512-channel row takes 256 + 32 = 288 bytes."""
    codes, scale_bytes = _encode_nvfp4(x)
    return _pack_nibbles(codes.reshape(x.shape)), scale_bytes.reshape(*x.shape[:-1], -1)


def unpack_nvfp4(packed: torch.Tensor, scale_bytes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(E2M1 bytes [..., C/2], E4M3 bytes [..., C/16]) from :func:`pack_nvfp4` -> [..., C] in ``dtype``."""
    codes = _unpack_nibbles(packed)
    blocks = codes.reshape(*scale_bytes.shape, 16)
    return _decode_nvfp4(blocks, scale_bytes[..., None]).reshape(codes.shape).to(dtype)


def pack_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] -> (E2M1 codes two a byte [..., C/2], E8M0 scale bytes [..., C/32]), uint8; unpacks
    to :func:`round_mxfp4` (x) exactly. A 128-channel index key takes 64 + 4 = 68 bytes."""
    codes, exps = _encode_mxfp4(x)
    return _pack_nibbles(codes.reshape(x.shape)), exps.reshape(*x.shape[:-1], -1)


def unpack_mxfp4(packed: torch.Tensor, exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(E2M1 bytes [..., C/2], E8M0 bytes [..., C/32]) from :func:`pack_mxfp4` -> [..., C] in ``dtype``."""
    codes = _unpack_nibbles(packed)
    blocks = codes.reshape(*exps.shape, 32)
    return _decode_mxfp4(blocks, exps[..., None]).reshape(codes.shape).to(dtype)


# -- DeepSeek-V4's FP8 KV record ("ds_mla", kv_spec.py ``ds_mla_format``) ---------------------------
# The official reference (inference/model.py) rounds each window row and compressed entry after its
# RoPE with ``act_quant(kv[..., :-rd], 64, "ue8m0", inplace=True)`` (inference/kernel.py): per block of
# 64 nope channels, amax = max(|x|, 1e-4) in float32, the scale ``2 ** ceil(log2(amax * (1 / 448)))``
# (the product rounded to float32, its log2's ceiling read exactly from the bits), x / scale clipped to
# [-448, 448] and cast to E4M3 (nearest, ties to even), times the scale again. The RoPE channels stay
# bf16. A nope width that 64 does not divide (test models) ends with a shorter block.

_FP8_MAX_INV = torch.tensor(1.0 / 448.0, dtype=torch.float32).item()   # the float32 constant 1/448


def _ds_mla_blocks(nope: torch.Tensor) -> tuple[torch.Tensor, int]:
    """nope [..., N] -> (float32 [..., ceil(N/64), 64] zero-padded, N)."""
    n = nope.shape[-1]
    nb = -(-n // DS_MLA_BLOCK)
    padded = torch.nn.functional.pad(nope.float(), (0, nb * DS_MLA_BLOCK - n))
    return padded.reshape(*nope.shape[:-1], nb, DS_MLA_BLOCK), n


def _ds_mla_scale_exps(blocks: torch.Tensor) -> torch.Tensor:
    """float32 blocks [..., NB, 64] -> E8M0 bytes [..., NB, 1] (uint8) of their power-of-two scales:
    ``ceil(log2(fl32(max(amax, 1e-4) * fl32(1/448))))`` from the product's bits (exact)."""
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    q = amax * torch.tensor(_FP8_MAX_INV, dtype=torch.float32, device=blocks.device)
    bits = q.view(torch.int32)
    # The biased exponent, plus one when any mantissa bit is set: 127 + ceil(log2(q)).
    return (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)).to(torch.uint8)


def _encode_ds_mla(x: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] -> (E4M3 bytes [..., D-R], bf16 RoPE values [..., R], E8M0 bytes [..., ceil((D-R)/64)])."""
    if x.shape[-1] <= rope_dim:
        raise ValueError(f"a ds_mla row needs more than its {rope_dim} RoPE channels, got {x.shape[-1]}")
    blocks, n = _ds_mla_blocks(x[..., :-rope_dim])
    exps = _ds_mla_scale_exps(blocks)
    q = (blocks / _e8m0_scale(exps)).clamp(-448.0, 448.0)
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)[..., :n]
    return codes, x[..., -rope_dim:].to(torch.bfloat16), exps[..., 0]


def _decode_ds_mla(codes: torch.Tensor, rope: torch.Tensor, exps: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_encode_ds_mla` -> float32 [..., D] (every value exact)."""
    n = codes.shape[-1]
    scale = _e8m0_scale(exps).repeat_interleave(DS_MLA_BLOCK, dim=-1)[..., :n]
    return torch.cat([codes.view(torch.float8_e4m3fn).float() * scale, rope.float()], dim=-1)


def round_ds_mla(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x [..., D] rounded as DeepSeek-V4 stores its KV (see above): the first D - R channels to E4M3
    with a power-of-two scale per 64, the trailing ``rope_dim`` channels to bf16 -> x's shape and dtype."""
    codes, rope, exps = _encode_ds_mla(x, rope_dim)
    return _decode_ds_mla(codes, rope, exps).to(x.dtype)


def pack_ds_mla(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """x [..., D] -> uint8 records [..., record_bytes(ds_mla_format(R), D)]: the E4M3 bytes, the
    bf16 RoPE values' bytes (little-endian), the E8M0 scale bytes, zero padding. Unpacks to
    :func:`round_ds_mla` (x) exactly."""
    codes, rope, exps = _encode_ds_mla(x, rope_dim)
    rope_bytes = rope.contiguous().view(torch.int16).to(torch.int32)
    rope_bytes = torch.stack([rope_bytes & 0xFF, (rope_bytes >> 8) & 0xFF], dim=-1).flatten(-2).to(torch.uint8)
    raw = torch.cat([codes, rope_bytes, exps], dim=-1)
    total = record_bytes(f"ds_mla_r{rope_dim}", x.shape[-1])
    return torch.nn.functional.pad(raw, (0, total - raw.shape[-1]))


def unpack_ds_mla(records: torch.Tensor, rope_dim: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 records from :func:`pack_ds_mla` -> [..., dim] in ``dtype``."""
    n = dim - rope_dim
    pairs = records[..., n:n + 2 * rope_dim].to(torch.int32).reshape(*records.shape[:-1], rope_dim, 2)
    rope = (pairs[..., 0] | (pairs[..., 1] << 8)).to(torch.int16).view(torch.bfloat16)
    exps = records[..., n + 2 * rope_dim:n + 2 * rope_dim + -(-n // DS_MLA_BLOCK)]
    return _decode_ds_mla(records[..., :n], rope, exps).to(dtype)


def round_record(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x rounded to what a ``fmt`` record holds (:func:`unpack_record` of :func:`pack_record`),
    in x's dtype: the values the torch path stores unpacked."""
    rope = ds_mla_rope(fmt)
    if rope is not None:
        return round_ds_mla(x, rope)
    return {"mxfp8": round_mxfp8, "nvfp4": round_nvfp4, "mxfp4": round_mxfp4}[fmt](x)


# One record a row: the values' bytes, then the scale bytes (kv_spec.py ``record_bytes``).
_PACKERS = {"mxfp8": (pack_mxfp8, unpack_mxfp8), "nvfp4": (pack_nvfp4, unpack_nvfp4),
            "mxfp4": (pack_mxfp4, unpack_mxfp4)}


def pack_record(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., C] -> uint8 records [..., record_bytes(fmt, C)]: :func:`pack_mxfp8` /
    :func:`pack_nvfp4` / :func:`pack_mxfp4`'s values, then their scales; :func:`pack_ds_mla`."""
    record_bytes(fmt, x.shape[-1])
    rope = ds_mla_rope(fmt)
    if rope is not None:
        return pack_ds_mla(x, rope)
    values, scales = _PACKERS[fmt][0](x)
    return torch.cat([values, scales], dim=-1)


def unpack_record(records: torch.Tensor, fmt: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 records [..., record_bytes(fmt, dim)] from :func:`pack_record` -> [..., dim] in ``dtype``."""
    if records.dtype != torch.uint8 or records.shape[-1] != record_bytes(fmt, dim):
        raise ValueError(f"{fmt} records of {dim} channels are uint8 rows of {record_bytes(fmt, dim)} bytes, "
                         f"got {records.dtype} rows of {records.shape[-1]}")
    rope = ds_mla_rope(fmt)
    if rope is not None:
        return unpack_ds_mla(records, rope, dim, dtype)
    n = record_value_bytes(fmt, dim)
    return _PACKERS[fmt][1](records[..., :n], records[..., n:], dtype)


def store_record(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor, fmt: str) -> None:
    """Pack each row of x [T, D] (:func:`pack_record`) and store it at its slot of the record
    cache [NB, bs, 1, 1, record_bytes(fmt, D)] (:func:`store_kv`; slots of -1 store nothing)."""
    store_kv(cache, slot_mapping, pack_record(x, fmt)[:, None])


# -- quantised weights as shipped (kernels/fp8_gemm.py, kernels/fp4_moe.py) ------------------------
# FP8 weights: e4m3 [N, K] with one scale per block_n x block_k tile (float32, or UE8M0 bytes
# 2 ** (b - 127)); FP4 experts: e2m1 codes two a byte [..., out, in/2] (low nibble first) with one
# scale per 32 inputs. Dequantisation is exact in float32 (models/quant.py).

def fp8_act_quant(x: torch.Tensor, group: int = 128, pow2_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group activation quantisation: x [M, K] -> (e4m3 [M, K], float32 scales [M, K/group]).

    Each group of ``group`` inputs of a row gets ``s = max(amax, 1e-4) / 448`` (``pow2_scale``:
    ``2 ** ceil(log2(s))`` computed exactly, a UE8M0 value); ``q = e4m3(clamp(x / s, -448, 448))``,
    rounded to nearest even.
    """
    blocks = _blocks(x, group)                                             # [M, K/group, group]
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    # A tensor divisor: torch divides by a Python scalar on CUDA as a product with its reciprocal
    # (one ulp off the quotient at times), by a tensor correctly rounded, as the kernels do.
    s = amax / torch.full_like(amax, 448.0)
    if pow2_scale:
        # ceil(log2(s)) exactly: s = m * 2^e with m in [0.5, 1), so it is e, or e - 1 when m = 0.5.
        m, e = torch.frexp(s)
        s = torch.ldexp(torch.ones_like(s), e - (m == 0.5).to(e.dtype))
    q = (blocks / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.reshape(x.shape), s.squeeze(-1)


def fp8_block_gemm(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """``dequant(xq, xs) @ dequant(w, ws)^T`` in float32, rounded once to ``out_dtype``.

    xq [M, K] e4m3 with xs [M, K/group] float32; w [N, K] e4m3 with ws [ceil(N/bn), K/bk] (float32 or
    UE8M0 bytes), ``block`` = (bn, bk) -> [M, N].
    """
    from deepinfer.models.quant import dequant_fp8_block
    group = xq.shape[1] // xs.shape[1]
    a = xq.float() * xs.float().repeat_interleave(group, dim=1)
    return (a @ dequant_fp8_block(w, ws, block).t()).to(out_dtype)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, block: tuple[int, int],
               group: int = 128, pow2_scale: bool = False, groups: int = 1) -> torch.Tensor:
    """x [..., K] quantised per 1 x ``group`` (:func:`fp8_act_quant`) times the FP8 weight
    (:func:`fp8_block_gemm`) -> [..., N] in x's dtype. ``groups`` > 1: the weight is
    block-diagonal, x [..., groups, K] -> [..., groups, N / groups], group g's inputs times the
    g-th N / groups rows of w."""
    if groups == 1:
        xq, xs = fp8_act_quant(x.reshape(-1, x.shape[-1]), group, pow2_scale)
        return fp8_block_gemm(xq, xs, w, ws, block, x.dtype).reshape(*x.shape[:-1], w.shape[0])
    from deepinfer.models.quant import dequant_fp8_block
    k = x.shape[-1]
    xq, xs = fp8_act_quant(x.reshape(-1, k), group, pow2_scale)                # [M * groups, K]
    a = (xq.float() * xs.repeat_interleave(group, dim=1)).view(-1, groups, k)
    wd = dequant_fp8_block(w, ws, block).view(groups, -1, k)                   # [groups, N / groups, K]
    out = torch.einsum("mgk,gnk->mgn", a, wd)
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0] // groups)


def fp4_moe_experts(x: torch.Tensor, gate_up_q: torch.Tensor, gate_up_s: torch.Tensor,
                    down_q: torch.Tensor, down_s: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, swiglu_limit: float, group: int = 32) -> torch.Tensor:
    """Routed experts over FP4 weights: :func:`clamped_moe_experts` (swiglu_limit 0: no clamp) with
    each routed expert's weights dequantised in float32 and rounded once to x's dtype (one expert at
    a time, so V4-Flash's 256 experts never exist dequantised all at once).

    x [T, H]; gate_up_q [E, 2I, H/2] uint8 with gate_up_s [E, 2I, H/group]; down_q [E, H, I/2] with
    down_s [E, H, I/group] (scales float32 or UE8M0 bytes); topk_weights, topk_ids [T, K] -> [T, H].
    """
    from deepinfer.models.quant import dequant_fp4_e2m1
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():                                       # ascending
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)              # [n] tokens routed to e
        gate_up = dequant_fp4_e2m1(gate_up_q[e], gate_up_s[e], group).to(x.dtype)   # [2I, H]
        down = dequant_fp4_e2m1(down_q[e], down_s[e], group).to(x.dtype)            # [H, I]
        gate, up = (x[tok] @ gate_up.t()).chunk(2, dim=-1)                   # [n, I] each
        h = clamped_swiglu(gate, up, swiglu_limit) @ down.t()                 # [n, H]
        out.index_add_(0, tok, (h * topk_weights[tok, slot, None]).to(out.dtype))
    return out


def fp4_moe_experts_fp8(x: torch.Tensor, gate_up_q: torch.Tensor, gate_up_s: torch.Tensor,
                        down_q: torch.Tensor, down_s: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, swiglu_limit: float, act_group: int = 32,
                        pow2_scale: bool = False, group: int = 32) -> torch.Tensor:
    """Routed experts over FP4 weights with FP8 activations, as the FP4 kernels' FP8 dots compute them.

    x is quantised once per token and ``act_group`` inputs (:func:`fp8_act_quant`, power-of-two
    scales with ``pow2_scale``); each routed expert's gate_up is the float32 product of those e4m3
    activations (times their scales) with the exactly dequantised weights; the clamped SwiGLU is
    rounded to x's dtype, quantised the same way, and multiplied by the dequantised down weights in
    float32; each slot's output times its routing weight is rounded to x's dtype and the K slots
    are summed in float32, then rounded. Shapes as :func:`fp4_moe_experts`.
    """
    from deepinfer.models.quant import dequant_fp4_e2m1

    def fp8(v: torch.Tensor) -> torch.Tensor:
        q, s = fp8_act_quant(v, act_group, pow2_scale)
        return q.float() * s.repeat_interleave(act_group, dim=1)

    t, k = topk_ids.shape
    xa = fp8(x)                                                                 # [T, H] float32
    out = torch.zeros(t, k, x.shape[1], dtype=torch.float32, device=x.device)   # [T, K, H]
    for e in topk_ids.unique().tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = (xa[tok] @ dequant_fp4_e2m1(gate_up_q[e], gate_up_s[e], group).t()).chunk(2, dim=-1)
        act = fp8(clamped_swiglu(gate, up, swiglu_limit).to(x.dtype))          # [n, I]
        h = act @ dequant_fp4_e2m1(down_q[e], down_s[e], group).t()          # [n, H]
        out[tok, slot] = (h * topk_weights[tok, slot, None]).to(x.dtype).float()
    return out.sum(dim=1).to(x.dtype)
