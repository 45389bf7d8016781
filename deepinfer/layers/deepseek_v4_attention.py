"""DeepSeek-V4 attention: shared-KV multi-query attention over a sliding window
plus compressed entries (CSA / HCA), with learned sinks.

Per layer (paper section 2.3; numerics as HF transformers' ``deepseek_v4``):

- queries: ``q = per-head-RMS(W_qb(RMSNorm(W_qa x)))``; one K=V vector per token,
  ``kv = RMSNorm(W_kv x)``; both get interleaved RoPE on their trailing R
  channels ("main" rope on sliding layers, "compress" rope (YaRN) on CSA/HCA);
- every query sees the last ``sliding_window`` tokens' kv;
- HCA (ratio r=128): a :class:`Compressor` pools each closed window of r tokens
  into one entry (softmax gate over the window's slots, per channel); a query
  at position p sees the entries ``w < (p+1) // r``;
- CSA (ratio r=4): the compressor's windows overlap (each entry pools 2r
  tokens: the previous window's first half-channels and its own window's
  second half), and a lightning :class:`Indexer` (its own small overlapping
  compressor + ``sum_h w_h relu(q_h . k)`` scores) keeps ``index_topk``
  visible entries per query;
- softmax over all visible keys plus a per-head sink logit; the inverse
  rotation is applied to the output's rope channels (V carried rope), then a
  grouped low-rank output projection.

KV cache. Every piece of state lives in paged caches (:class:`CacheSlot`), so
chunked prefill, decode, prefix caching and preemption are exact with no
per-sequence side state:

- ``window_cache`` (sliding, window W): each token's kv;
- ``state_cache`` of a compressor (sliding): each token's projected kv and raw
  gate; an entry only needs the tokens of its own (and, for CSA, the previous)
  window, so a window of ``max(2r or r, W)`` tokens suffices;
- ``entry_cache`` (compressed, ratio r): the pooled entries; the indexer's
  keys are a second compressed cache. Entry ``w`` is written when token
  ``(w+1)*r - 1`` is processed; entry slots come from the group's block table.

Without a cache (``ctx.groups`` empty) each sequence of the batch attends to
its own tokens, which must start at position 0.

Shapes: T tokens, Hd hidden size, H query heads, D head_dim, R rope dims,
r compress ratio, C compressor width (2D when overlapping, else D), N entries
of one sequence, Hi/Di indexer heads/head dim, Tq one sequence's new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.forward_context import ForwardContext
from deepinfer.kernels import reference
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.layers.deepseek_v4_common import (CacheSlot, InterleavedRope, RMSNorm,
                                                 apply_interleaved_rope, rms_unweighted)

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)


@dataclass(frozen=True)
class DeepseekV4AttentionConfig:
    hidden_size: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rms_norm_eps: float
    sliding_window: int
    layer_type: str
    compress_ratio: int          # of this layer's type; 0 for sliding layers
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    cache_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"layer type {self.layer_type!r} is not one of {LAYER_TYPES}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"num_attention_heads * head_dim = {self.num_heads * self.head_dim} must be "
                             f"divisible by o_groups={self.o_groups}")
        if self.layer_type != SLIDING and self.compress_ratio < 2:
            raise ValueError(f"{self.layer_type} needs a compress rate >= 2, got {self.compress_ratio}")


class GroupedLinear(nn.Linear):
    """Block-diagonal projection: group g's [Hd/g] slice -> its own [out/g] outputs.

    weight: [out, in_per_group] holding the g groups' matrices stacked on rows.
    """

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, g, in_per_group] -> [T, g, out/g]
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)     # [g, in, out/g]
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)


def _entry_slots(block_row: torch.Tensor, block_size: int, w0: int, w1: int) -> torch.Tensor:
    w = torch.arange(w0, w1, device=block_row.device)
    return block_row.long()[w // block_size] * block_size + w % block_size


class GatedPool(nn.Module):
    """Compresses each closed window of ``ratio`` tokens into one entry:
    ``kv_norm(sum_slots softmax_slots(gate + position_bias) * kv)`` (per channel),
    then RoPE at the window's first position. With ``overlap`` the projections
    are 2D wide: entry w pools window w-1's first D channels with window w's last D."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, overlap: bool, eps: float,
                 sliding_window: int, cache_dtype: torch.dtype) -> None:
        super().__init__()
        self.ratio = ratio
        self.head_dim = head_dim
        self.overlap = overlap
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps)
        self.state_cache = CacheSlot(KVCacheSpec(
            kind="sliding", num_kv_heads=1, head_size=width, dtype=cache_dtype, num_tensors=2,
            sliding_window=max((2 if overlap else 1) * ratio, sliding_window)))
        self.entry_cache = CacheSlot(KVCacheSpec(
            kind="compressed", num_kv_heads=1, head_size=head_dim, dtype=cache_dtype, num_tensors=1,
            compress_ratio=ratio))

    def project(self, x: torch.Tensor, ctx: ForwardContext,
                cached: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token pooling inputs (kv [T, C], raw gate [T, C]), stored in the state cache when cached."""
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if cached:
            reference.store_kv(self.state_cache.kv_cache, self.state_cache.meta(ctx).slot_mapping,
                               kv[:, None], gate[:, None])
        return kv, gate

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, w0: int, rope: InterleavedRope) -> torch.Tensor:
        """Entries w0 .. w1-1 from the states of tokens ``max(0, w0 - overlap) * r .. w1*r - 1``.

        kv, gate: [M, C] -> [w1 - w0, D]
        """
        r, d = self.ratio, self.head_dim
        if self.overlap:
            if w0 == 0:
                # No window precedes the first: its slots get softmax weight 0.
                kv = torch.cat([kv.new_zeros(r, 2 * d), kv])
                gate = torch.cat([gate.new_full((r, 2 * d), float("-inf")), gate])
            n = kv.shape[0] // r - 1
            kv = kv.view(n + 1, r, 2 * d)
            gate = gate.view(n + 1, r, 2 * d) + self.position_bias
            kv = torch.cat([kv[:-1, :, :d], kv[1:, :, d:]], dim=1)                  # [n, 2r, D]
            gate = torch.cat([gate[:-1, :, :d], gate[1:, :, d:]], dim=1)
        else:
            n = kv.shape[0] // r
            kv = kv.view(n, r, d)
            gate = gate.view(n, r, d) + self.position_bias
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))                           # [n, D]
        cos, sin = rope.cos_sin(torch.arange(w0, w0 + n, device=kv.device) * r)
        return apply_interleaved_rope(entries, cos, sin)

    def sequence_entries(self, kv: torch.Tensor, gate: torch.Tensor, start: int, end: int,
                         seq: int, ctx: ForwardContext, rope: InterleavedRope,
                         cached: bool) -> torch.Tensor:
        """All entries of sequence ``seq`` after this step: [end // r, D].

        kv, gate: [Tq, C] states of its new tokens ``start .. end-1``. New entries
        are pooled and (when cached) written; earlier ones come from the entry cache.
        """
        r = self.ratio
        w0, w1 = start // r, end // r
        if not cached:
            return self.pool(kv[: w1 * r], gate[: w1 * r], 0, rope)
        entry_meta = self.entry_cache.meta(ctx)
        if w1 > w0:
            lo = max(0, w0 - int(self.overlap)) * r
            old = reference.gather_kv(self.state_cache.kv_cache, self.state_cache.meta(ctx).block_table[seq],
                                      lo, start)                                   # [start-lo, 2, 1, C]
            new = self.pool(torch.cat([old[:, 0, 0], kv[: w1 * r - start]]),
                            torch.cat([old[:, 1, 0], gate[: w1 * r - start]]), w0, rope)
            slots = _entry_slots(entry_meta.block_table[seq], entry_meta.block_size, w0, w1)
            reference.store_kv(self.entry_cache.kv_cache, slots, new[:, None])
        return reference.gather_kv(self.entry_cache.kv_cache, entry_meta.block_table[seq], 0, w1)[:, 0, 0]

    def cache_slots(self) -> list[CacheSlot]:
        return [self.state_cache, self.entry_cache]


class IndexerScorer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)


class Indexer(GatedPool):
    """Lightning indexer: its own overlapping compressor at ``index_head_dim``
    gives one key per entry; query t scores entry s as
    ``sum_h w_{t,h} relu(q_{t,h} . k_s) / sqrt(Di)`` with ``w = W_w x / sqrt(Hi)``,
    and keeps the ``index_topk`` best of the entries it may see."""

    def __init__(self, cfg: DeepseekV4AttentionConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.index_head_dim, cfg.compress_ratio, True,
                         cfg.rms_norm_eps, cfg.sliding_window, cfg.cache_dtype)
        self.num_heads = cfg.index_n_heads
        self.index_topk = cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.scorer = IndexerScorer(cfg.hidden_size, cfg.index_n_heads)

    def select(self, keys: torch.Tensor, q_residual: torch.Tensor, x: torch.Tensor,
               q_pos: torch.Tensor, rope: InterleavedRope) -> torch.Tensor:
        """keys [N, Di]; q_residual [Tq, q_lora]; x [Tq, Hd]; q_pos [Tq] -> allowed [Tq, N] bool."""
        tq, n = x.shape[0], keys.shape[0]
        cos, sin = rope.cos_sin(q_pos)
        q = apply_interleaved_rope(self.q_b_proj(q_residual).view(tq, self.num_heads, self.head_dim),
                                   cos, sin)                                      # [Tq, Hi, Di]
        scores = torch.relu(torch.matmul(q.float(), keys.float().t())) * self.head_dim ** -0.5  # [Tq, Hi, N]
        weights = self.scorer.weights_proj(x).float() * self.num_heads ** -0.5   # [Tq, Hi]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)                      # [Tq, N]
        visible = torch.arange(n, device=x.device)[None, :] < ((q_pos + 1) // self.ratio)[:, None]
        top = scores.masked_fill(~visible, float("-inf")).topk(min(self.index_topk, n), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(1, top, True)
        return chosen & visible


class Compressor(GatedPool):
    """The layer's compressor: overlapping with an indexer for CSA, plain for HCA."""

    def __init__(self, cfg: DeepseekV4AttentionConfig) -> None:
        sparse = cfg.layer_type == CSA
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.compress_ratio, sparse, cfg.rms_norm_eps,
                         cfg.sliding_window, cfg.cache_dtype)
        self.indexer = Indexer(cfg) if sparse else None

    def visible_entries(self, x: torch.Tensor, q_residual: torch.Tensor, ctx: ForwardContext,
                        rope: InterleavedRope, cached: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sequence: (its entries [N, D], which of them each new token sees [Tq, N] bool)."""
        kv, gate = self.project(x, ctx, cached)
        if self.indexer is not None:
            ikv, igate = self.indexer.project(x, ctx, cached)
        result = []
        for b in range(ctx.num_seqs):
            s, e = ctx.query_start_loc[b], ctx.query_start_loc[b + 1]
            end = ctx.seq_lens[b]
            start = end - (e - s)
            q_pos = ctx.positions[s:e]
            entries = self.sequence_entries(kv[s:e], gate[s:e], start, end, b, ctx, rope, cached)
            if self.indexer is None:
                n = entries.shape[0]
                allowed = torch.arange(n, device=x.device)[None, :] < ((q_pos + 1) // self.ratio)[:, None]
            else:
                keys = self.indexer.sequence_entries(ikv[s:e], igate[s:e], start, end, b, ctx, rope, cached)
                allowed = self.indexer.select(keys, q_residual[s:e], x[s:e], q_pos, rope)
            result.append((entries, allowed))
        return result

    def cache_slots(self) -> list[CacheSlot]:
        return super().cache_slots() + (self.indexer.cache_slots() if self.indexer is not None else [])


class DeepseekV4Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4AttentionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.o_groups = cfg.o_groups
        self.eps = cfg.rms_norm_eps
        self.sliding_window = cfg.sliding_window
        self.scale = cfg.head_dim ** -0.5
        # Sliding layers use the plain "main" rope; CSA/HCA layers share the compressor's YaRN rope.
        self.rope_type = "main" if cfg.layer_type == SLIDING else "compress"
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.num_heads * cfg.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(cfg.num_heads * cfg.head_dim // cfg.o_groups,
                                      cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads, dtype=torch.float32))
        self.compressor = Compressor(cfg) if cfg.layer_type != SLIDING else None
        self.window_cache = CacheSlot(KVCacheSpec(
            kind="sliding", num_kv_heads=1, head_size=cfg.head_dim, dtype=cfg.cache_dtype,
            num_tensors=1, sliding_window=cfg.sliding_window))

    def cache_slots(self) -> list[CacheSlot]:
        return [self.window_cache] + (self.compressor.cache_slots() if self.compressor is not None else [])

    def forward(self, x: torch.Tensor, ctx: ForwardContext,
                ropes: dict[str, InterleavedRope]) -> torch.Tensor:
        # x: [T, Hd] (normed block input) -> [T, Hd]
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        cached = bool(ctx.groups) and self.window_cache.kv_cache is not None
        if not cached:
            for b, (q_len, seq_len) in enumerate(zip(ctx.query_lens, ctx.seq_lens)):
                if q_len != seq_len:
                    raise ValueError(f"sequence {b} has {q_len} new of {seq_len} tokens: without a KV "
                                     "cache each sequence must be given whole, from position 0")
        rope = ropes[self.rope_type]
        cos, sin = rope.cos_sin(ctx.positions)                                    # [T, R/2]
        q_residual = self.q_a_norm(self.q_a_proj(x))                              # [T, q_lora]
        q = rms_unweighted(self.q_b_proj(q_residual).view(t, h, d), self.eps)
        q = apply_interleaved_rope(q, cos, sin)                                   # [T, H, D]
        kv = apply_interleaved_rope(self.kv_norm(self.kv_proj(x)), cos, sin)      # [T, D]
        if cached:
            window_meta = self.window_cache.meta(ctx)
            reference.store_kv(self.window_cache.kv_cache, window_meta.slot_mapping, kv[:, None])
        compressed = (self.compressor.visible_entries(x, q_residual, ctx, ropes["compress"], cached)
                      if self.compressor is not None else None)

        out = torch.empty_like(q)
        for b in range(ctx.num_seqs):
            s, e = ctx.query_start_loc[b], ctx.query_start_loc[b + 1]
            if e == s:
                continue
            end = ctx.seq_lens[b]
            start = end - (e - s)
            q_pos = ctx.positions[s:e]
            if cached:
                first = max(0, start - self.sliding_window + 1)
                keys = reference.gather_kv(self.window_cache.kv_cache, window_meta.block_table[b],
                                           first, end)[:, 0, 0]                   # [Tk, D]
                k_pos = torch.arange(first, end, device=x.device)
            else:
                keys, k_pos = kv[s:e], q_pos
            back = q_pos[:, None] - k_pos[None, :]                                 # [Tq, Tk]
            allowed = (back >= 0) & (back < self.sliding_window)
            if compressed is not None:
                entries, entry_allowed = compressed[b]
                keys = torch.cat([keys, entries])
                allowed = torch.cat([allowed, entry_allowed], dim=1)
            out[s:e] = reference.masked_sink_attention(q[s:e], keys, allowed, self.sinks, self.scale)

        # V carried rope on its trailing channels: undo it at the query position.
        out = apply_interleaved_rope(out, cos, -sin)
        return self.o_b_proj(self.o_a_proj(out.view(t, self.o_groups, -1)).flatten(1))
