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
  keys are a second compressed cache in the same group. Entry ``w`` is written
  when token ``(w+1)*r - 1`` is processed; entry slots come from the group's
  block table.

Forward, batched over the whole step (no loop over sequences):

0. project the block input x once: q_a, kv, and the compressor's and indexer's
   kv/gate/weights projections are one GEMM after :meth:`DeepseekV4Attention.fuse_projections`
   (layers/fused_linear.py; separate GEMMs before it), whose pieces are passed down;
1. store every new token's kv in the window cache and its pooling states in the
   state caches;
2. pool the entry of every token that completes a window (``(p+1) % r == 0``)
   from the states gathered by slot, and store it at its entry slot;
3. build per-token flat slot tables (``block_table[seq, i // bs] * bs + i % bs``,
   -1 for none): the window's positions ``p-W+1 .. p`` [T, W], and the entries
   ``0 .. (p+1)//r - 1`` [T, Nmax] with ``Nmax = ceil(max_seq_len / r)``; CSA
   keeps the indexer's top-k of those;
4. one sparse attention over (window cache, window slots) and (entry cache,
   entry slots).

FP8 KV (``kv_record``, the model's ``kv_cache_dtype="fp8"``): window rows and the
compressor's entries are rounded as DeepSeek's reference stores them (kv_spec.py
``ds_mla_format``: the nope channels E4M3 with a power-of-two scale per 64, the RoPE channels
bf16). With ``packed_kv`` (where the Triton kernels run) the two caches hold the 584-byte
records (at D = 512), encoded by ``backend.store_record`` and decoded in registers by the
attention; otherwise the rounded values are stored unpacked in the cache dtype (the CPU
reference path). Entries are pooled into a [M, D] buffer first, then stored. The indexer's
keys and the compressor states stay in the cache dtype.

A ``decode_only`` context (CUDA-graph capturable, forward_context.py) takes no
host data: step 2 pools for every token and stores the entries of tokens that
complete no window at slot -1, which the store skips; all shapes come from T
and ``max_seq_len``. Other contexts size step 2 from the host lists, still
without a host sync.

Under context parallelism (``ctx.cp``, parallel/context.py) a rank's context holds its own
tokens: it gathers the step's raw kv and pooling inputs from every rank, stores the whole
step's window rows and states and pools every entry the step completes (over the step's
context, ``ctx.cp.step``), so every rank keeps the whole sequence's caches; its queries then
read them through its own context's slot tables.

Without a cache (``ctx.groups`` empty) each sequence of the batch attends to
its own tokens, which must start at position 0; the same code runs over
scratch caches of one row per token.

Shapes: T tokens, Hd hidden size, H query heads, D head_dim, R rope dims,
r compress ratio, C compressor width (2D when overlapping, else D), M pooled
tokens, S pooled states per entry (2r or r), Nmax entry slots per token, K
attended entries per token, Hi/Di indexer heads/head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from deepinfer import batch_invariant

from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.kernels import backend, reference
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.layers import side_stream
from deepinfer.layers.deepseek_v4_common import CacheSlot, InterleavedRope, RMSNorm
from deepinfer.layers.quant_linear import fp8_input
from deepinfer.layers.fused_linear import FusedProjection
from deepinfer.parallel.groups import current_groups
from deepinfer.parallel.tensor import ColumnParallelLinear, RowParallelLinear, mark_shard
from deepinfer.transfer import to_device

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
    # FP8 KV: the record format of the window rows and compressed entries (kv_spec.py
    # ``ds_mla_format``), None for values of cache_dtype; ``packed_kv`` stores it as records.
    kv_record: str | None = None
    packed_kv: bool = False

    def __post_init__(self) -> None:
        if self.packed_kv and self.kv_record is None:
            raise ValueError("packed_kv needs a kv_record format")
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
        if batch_invariant.enabled():
            # The mode replaces the functional bmm only (its tiles run the out= form).
            return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)
        # Written in place through a [g, T, out/g] view, so the caller's flatten is free
        # (bmm into a fresh [g, T, out/g] then flatten copied it: 84 us at T=4096 on the H200).
        out = x.new_empty(x.shape[0], self.groups, w.shape[2])
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return out


def value_spec(cfg: DeepseekV4AttentionConfig, **kw) -> KVCacheSpec:
    """A one-tensor cache of ``head_dim`` rows for window rows or entries: ``kv_record``
    records when packed, else values of the cache dtype."""
    if cfg.packed_kv:
        return KVCacheSpec(num_kv_heads=1, head_size=cfg.head_dim, dtype=torch.uint8, num_tensors=1,
                           record=cfg.kv_record, **kw)
    return KVCacheSpec(num_kv_heads=1, head_size=cfg.head_dim, dtype=cfg.cache_dtype, num_tensors=1, **kw)


def store_rows(view: "PagedView", slot_mapping: torch.Tensor, x: torch.Tensor, fmt: str) -> None:
    """Store rows x [T, D] at their slots (-1: none): encoded as ``fmt`` records in a record
    cache, else rounded to what the record holds and stored as values."""
    if view.record is not None:
        backend.store_record(view.cache, slot_mapping, x, fmt)
        return
    backend.store_kv(view.cache, slot_mapping, reference.round_record(x, fmt)[:, None].to(view.cache.dtype))


@dataclass
class PagedView:
    """One cache as this step sees it: the tensor [NB, bs, nt, 1, C] and its group's metadata;
    ``record``: the format of a packed record cache (C is then the record's bytes), else None."""

    cache: torch.Tensor
    meta: GroupMetadata
    record: str | None = None

    def slots(self, ctx: ForwardContext, width: int, ratio: int, sliding: bool) -> torch.Tensor:
        """[T, width] int64 flat slots (``block_table[seq, i // bs] * bs + i % bs``) of what each
        token sees, -1 for none: ``sliding``, its window's last ``width`` tokens; otherwise the
        compressed entries ``0 .. (p+1)//ratio - 1`` (see :func:`reference.paged_slots`).
        Layers of one KV-cache group share the table: it is built once per forward."""
        key = ("paged_slots", id(self.meta), width, ratio, sliding)
        hit = ctx.memo.get(key)
        if hit is None or hit[0] is not self.meta:
            table = backend.paged_slots(self.meta.block_table, self.meta.block_size, ctx.token_seq,
                                        ctx.positions, width, ratio, sliding)
            hit = ctx.memo[key] = (self.meta, table)      # holding meta keeps its id unique
        return hit[1]


class StepCaches:
    """The caches of one forward. With a paged cache: each layer's bound cache and its
    group's metadata. Without one: zeroed scratch caches of one row per token, where
    sequence b's token (or entry) i sits at row ``query_start_loc[b] + i`` (block size 1),
    so that both modes run the same batched code."""

    def __init__(self, ctx: ForwardContext, cached: bool, x: torch.Tensor) -> None:
        self.ctx = ctx
        self.num_tokens, self.dtype, self.device = x.shape[0], x.dtype, x.device
        self.scratch: GroupMetadata | None = None
        self.bound: dict[int, PagedView] = {}
        if not cached:
            rows = torch.arange(max(1, ctx.max_seq_len), device=x.device)
            table = ctx.query_start_loc_t[:-1, None].long() + rows[None, :]       # [B, max_seq_len]
            self.scratch = GroupMetadata(block_size=1, block_table=table,
                                         slot_mapping=torch.arange(self.num_tokens, device=x.device))

    def bind(self, slot: CacheSlot) -> PagedView:
        spec = slot.kv_spec
        if self.scratch is None:
            return PagedView(slot.kv_cache, slot.meta(self.ctx), spec.record)
        if id(slot) not in self.bound:
            # Scratch values in the compute dtype; packed records as bytes.
            cache = torch.zeros(self.num_tokens, 1, spec.num_tensors, 1, spec.row_size,
                                dtype=self.dtype if spec.record is None else spec.dtype, device=self.device)
            self.bound[id(slot)] = PagedView(cache, self.scratch, spec.record)
        return self.bound[id(slot)]


def completing_tokens(ctx: ForwardContext, ratio: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(sequence row [M] int32, position [M] int64) of the tokens that complete a window of
    ``ratio`` tokens (``(p+1) % ratio == 0``), in token order; None in a decode_only
    context, which pools every row instead.

    Built on the host from the context's lists (sequence b's new tokens sit at positions
    ``seq_lens[b] - n_b .. seq_lens[b] - 1``) and copied without a host sync, once per forward
    and ratio: the layers of a forward share it. (Computed on the device from the positions it
    took a cumsum, a scatter and two gathers per pool, a dozen small launches per layer.)
    """
    if ctx.decode_only:
        return None
    key = ("completing", ratio)
    hit = ctx.memo.get(key)
    if hit is None:
        q = ctx.query_start_loc
        seqs, positions = [], []
        for b, end in enumerate(ctx.seq_lens):
            start = end - (q[b + 1] - q[b])
            pos = np.arange((start + ratio) // ratio * ratio - 1, end, ratio, dtype=np.int64)
            positions.append(pos)
            seqs.append(np.full(pos.shape[0], b, dtype=np.int32))
        device = ctx.positions.device
        hit = ctx.memo[key] = (to_device(np.concatenate(seqs or [np.zeros(0, np.int32)]), torch.int32, device),
                               to_device(np.concatenate(positions or [np.zeros(0, np.int64)]), torch.int64, device))
    return hit


class GatedPool(nn.Module):
    """Compresses each closed window of ``ratio`` tokens into one entry:
    ``kv_norm(sum_slots softmax_slots(gate + position_bias) * kv)`` (per channel),
    then RoPE at the window's first position. With ``overlap`` the projections
    are 2D wide: entry w pools window w-1's first D channels with window w's last D."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, overlap: bool, eps: float,
                 sliding_window: int, cache_dtype: torch.dtype,
                 entry_spec: KVCacheSpec | None = None, kv_record: str | None = None) -> None:
        super().__init__()
        self.ratio = ratio
        self.head_dim = head_dim
        self.overlap = overlap
        self.cache_dtype = cache_dtype
        # FP8 entries (the layer's compressor): pooled into a buffer, then rounded or encoded.
        self.kv_record = kv_record
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = nn.Linear(hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps)
        self.state_cache = CacheSlot(KVCacheSpec(
            kind="sliding", num_kv_heads=1, head_size=width, dtype=cache_dtype, num_tensors=2,
            sliding_window=max((2 if overlap else 1) * ratio, sliding_window)))
        self.entry_cache = CacheSlot(entry_spec or KVCacheSpec(
            kind="compressed", num_kv_heads=1, head_size=head_dim, dtype=cache_dtype, num_tensors=1,
            compress_ratio=ratio))

    def projections(self) -> list[nn.Linear]:
        """The projections of the block input x this pool takes, in :meth:`update`'s order
        (the attention computes them, fused with its own)."""
        return [self.kv_proj, self.gate_proj]

    def update(self, kv: torch.Tensor, gate: torch.Tensor, ctx: ForwardContext, caches: StepCaches,
               rope: InterleavedRope, completing: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Stores every new token's pooling states (kv, raw gate) in the state cache, then
        pools the entry each ``completing`` token completes (its sequence row and position,
        [M] each: :func:`completing_tokens`) and stores it at its entry slot.

        kv, gate: [T, C], ``kv_proj(x)`` and ``gate_proj(x)`` (any row stride). ``completing``
        None passes every token (graph-safe decode); tokens that complete no window write nothing.
        """
        r = self.ratio
        state, entries = caches.bind(self.state_cache), caches.bind(self.entry_cache)
        state_meta, entry_meta = state.meta, entries.meta
        if ctx.cp is not None:
            # A context-parallel share: every rank stores the whole step's states (every rank's
            # rows, in token order) and pools every entry the step completes, so each keeps
            # the whole sequence's entries (parallel/context.py).
            kv, gate = ctx.cp.gather(torch.cat((kv, gate), dim=-1)).split(kv.shape[1], dim=-1)
            ctx = ctx.cp.step
            completing = completing_tokens(ctx, r)
            state_meta, entry_meta = self.state_cache.meta(ctx), self.entry_cache.meta(ctx)
        backend.store_kv(state.cache, state_meta.slot_mapping, kv[:, None], gate[:, None])
        seq, pos = ctx.token_seq, ctx.positions                                    # [T]
        if completing is not None:
            seq, pos = completing                                                   # [M]
        if self.kv_record is None:
            backend.compress_entries_(state.cache, state_meta.block_table, entries.cache, entry_meta.block_table,
                                      seq, pos, self.position_bias, self.kv_norm.weight, self.kv_norm.eps,
                                      rope.inv_freq, rope.scaling, r, self.overlap)
            return
        # Row m's entry into rows[m], then stored at its entry slot (-1: it completes no window).
        rows = torch.zeros(seq.shape[0], 1, 1, 1, self.head_dim, dtype=self.cache_dtype, device=kv.device)
        backend.compress_entries_(state.cache, state_meta.block_table, rows, None, seq, pos,
                                  self.position_bias, self.kv_norm.weight, self.kv_norm.eps,
                                  rope.inv_freq, rope.scaling, r, self.overlap)
        pos = pos.long()
        completed = torch.where((pos + 1) % r == 0, (pos + 1) // r - 1, -1)
        slots = reference.table_slots(entry_meta.block_table, entries.cache.shape[1], seq.long(),
                                      completed[:, None])[:, 0]
        store_rows(entries, slots, rows[:, 0, 0, 0], self.kv_record)

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

    def projections(self) -> list[nn.Linear]:
        """The pool's projections of x, then the scorer's (``weights`` of :meth:`select`)."""
        return super().projections() + [self.scorer.weights_proj]

    def select(self, q_residual: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
               rope: InterleavedRope, keys: PagedView, candidates: torch.Tensor,
               token_seq: torch.Tensor | None) -> torch.Tensor:
        """The best ``index_topk`` candidates of each token: [T, min(topk, Nmax)] slots of the
        key cache, -1 where fewer are visible.

        q_residual: [T, q_lora]; weights: [T, Hi] ``scorer.weights_proj(x)``; positions: [T];
        candidates: [T, Nmax] key slots (:meth:`PagedView.slots`: one sequence's tokens see
        prefixes of one row); token_seq: [T] sequence of each token, which lets the scores
        load a key once for a block of one sequence's tokens (prefill), or None (decode).
        """
        t = q_residual.shape[0]
        q = backend.interleaved_rope(self.q_b_proj(q_residual).view(t, self.num_heads, self.head_dim),
                                     positions, rope.inv_freq, rope.scaling)          # [T, Hi, Di]
        weights = weights.float() * self.num_heads ** -0.5                         # [T, Hi]
        return backend.indexer_topk(q, weights, keys.cache, candidates, self.head_dim ** -0.5,
                                    self.index_topk, token_seq)


class Compressor(GatedPool):
    """The layer's compressor: overlapping with an indexer for CSA, plain for HCA."""

    def __init__(self, cfg: DeepseekV4AttentionConfig) -> None:
        sparse = cfg.layer_type == CSA
        super().__init__(cfg.hidden_size, cfg.head_dim, cfg.compress_ratio, sparse, cfg.rms_norm_eps,
                         cfg.sliding_window, cfg.cache_dtype,
                         value_spec(cfg, kind="compressed", compress_ratio=cfg.compress_ratio), cfg.kv_record)
        self.indexer = Indexer(cfg) if sparse else None

    def projections(self) -> list[nn.Linear]:
        """The pool's projections of x, then the indexer's: the order of ``projected``
        in :meth:`attended_entries`."""
        return super().projections() + (self.indexer.projections() if self.indexer is not None else [])

    def attended_entries(self, projected: tuple[torch.Tensor, ...], q_residual: torch.Tensor,
                         ctx: ForwardContext, caches: StepCaches,
                         rope: InterleavedRope) -> tuple[torch.Tensor, torch.Tensor]:
        """Pools and stores this step's entries; returns (the entry cache, [T, K] slots of
        the entries each token attends to, -1 for none).

        projected: the block input's projections in :meth:`projections` order, each [T, N_i].
        """
        r = self.ratio
        completing = completing_tokens(ctx, r)
        kv, gate = projected[:2]
        self.update(kv, gate, ctx, caches, rope, completing)
        entries = caches.bind(self.entry_cache)
        n_max = max(1, -(-ctx.max_seq_len // r))
        slots = entries.slots(ctx, n_max, r, sliding=False)                           # [T, Nmax]
        if self.indexer is None:
            return entries.cache, slots
        index_kv, index_gate, index_weights = projected[2:]
        self.indexer.update(index_kv, index_gate, ctx, caches, rope, completing)
        keys = caches.bind(self.indexer.entry_cache)
        if keys.meta is not entries.meta:
            raise RuntimeError("the indexer's keys and the compressed entries must share one KV-cache "
                               "group: the top-k key slots are used as entry slots")
        # A decode_only context has one token a sequence: no candidates to share.
        token_seq = None if ctx.decode_only else ctx.token_seq
        return entries.cache, self.indexer.select(q_residual, index_weights, ctx.positions, rope, keys,
                                                  slots, token_seq)

    def cache_slots(self) -> list[CacheSlot]:
        return super().cache_slots() + (self.indexer.cache_slots() if self.indexer is not None else [])


class DeepseekV4Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4AttentionConfig) -> None:
        super().__init__()
        # Tensor parallelism shards the heads and with them the output groups: q_b and
        # o_a (block-diagonal by group) keep this rank's, o_b sums the ranks' partial outputs.
        # The one shared KV head, the compressor and the indexer are every rank's.
        tp = current_groups().tp
        self.num_heads = cfg.num_heads // tp.size
        self.head_dim = cfg.head_dim
        self.o_groups = cfg.o_groups // tp.size
        self.eps = cfg.rms_norm_eps
        self.sliding_window = cfg.sliding_window
        self.scale = cfg.head_dim ** -0.5
        # Sliding layers use the plain "main" rope; CSA/HCA layers share the compressor's YaRN rope.
        self.rope_type = "main" if cfg.layer_type == SLIDING else "compress"
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, cfg.num_heads * cfg.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(cfg.num_heads * cfg.head_dim // cfg.o_groups,
                                      self.o_groups * cfg.o_lora_rank, self.o_groups)
        mark_shard(self.o_a_proj.weight, 0, tp)
        self.o_b_proj = RowParallelLinear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        mark_shard(self.sinks, 0, tp)
        self.compressor = Compressor(cfg) if cfg.layer_type != SLIDING else None
        self.kv_record = cfg.kv_record
        self.window_cache = CacheSlot(value_spec(cfg, kind="sliding", sliding_window=cfg.sliding_window))
        # Every projection of the block input x (q_a, kv, then the compressor's and the
        # indexer's): one GEMM once fuse_projections() has run (layers/fused_linear.py).
        self.input_proj = FusedProjection(
            [self.q_a_proj, self.kv_proj]
            + (self.compressor.projections() if self.compressor is not None else []))

    def fuse_projections(self) -> None:
        """Store the projections of x in one buffer and compute them as one GEMM; called
        once the weights are loaded (``CausalLM.after_load``)."""
        self.input_proj.fuse()

    def note_fp8_inputs(self) -> None:
        """With an FP8 q_b (and the indexer's, reading the same q_residual), the q_a norm
        quantises its output for them in its own launch (both then skip their act-quant)."""
        self.q_a_norm.fp8_out = fp8_input(self.q_b_proj)

    def fp8_input(self) -> tuple[int, bool] | None:
        """(group, pow2_scale) of the FP8 projections that read the block input x, or None."""
        return fp8_input(self.q_a_proj)

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
        caches = StepCaches(ctx, cached, x)
        rope, pos = ropes[self.rope_type], ctx.positions
        q_a, kv, *projected = self.input_proj(x)                                  # [T, N_i] each
        q_residual = self.q_a_norm(q_a)                                           # [T, q_lora]
        # The compressor and indexer (a chain of small launches at decode sizes) write only
        # their own caches: on a side stream they run beside the query projection.
        # (Not under context parallelism: the compressor's all-gathers stay on the main stream.)
        side = side_stream.fork(x) if self.compressor is not None and ctx.cp is None else None
        with side_stream.on(side):
            entries = (self.compressor.attended_entries(tuple(projected), q_residual, ctx, caches,
                                                        ropes["compress"])
                       if self.compressor is not None else None)
        q = self.q_b_proj(q_residual).view(t, h, d)                               # [T, H, D], raw
        window = caches.bind(self.window_cache)
        # kv = rope(kv_norm(W_kv x)) [T, D], stored in the window cache in the same launch; FP8
        # rows are rounded or encoded by a second one. A context-parallel share stores the whole
        # step's window rows: every rank's raw kv, normed and roped at its own position.
        kv_pos = pos
        if ctx.cp is not None:
            kv, kv_pos = ctx.cp.gather(kv), ctx.cp.step.positions
        if self.kv_record is None:
            backend.kv_norm_rope(kv, self.kv_norm.weight, kv_pos, rope.inv_freq, rope.scaling,
                                 self.kv_norm.eps, window.cache, window.meta.slot_mapping)
        else:
            kv = backend.kv_norm_rope(kv, self.kv_norm.weight, kv_pos, rope.inv_freq, rope.scaling,
                                      self.kv_norm.eps)
            store_rows(window, window.meta.slot_mapping, kv, self.kv_record)
        sources = [(window.cache, window.slots(ctx, self.sliding_window, 1, sliding=True))]  # [T, W]
        formats = [window.record]
        side_stream.join(side)
        if entries is not None:
            sources.append(entries)
            formats.append(self.compressor.entry_cache.kv_spec.record)
        # q's norm and rope, the attention, and the inverse rope of the output (V carried the
        # rope on its trailing channels: undone at the query position).
        out = backend.rope_attention(q, pos, rope.inv_freq, rope.scaling, self.eps, sources, self.sinks,
                                     self.scale, formats)                                  # [T, H, D]
        return self.o_b_proj(self.o_a_proj(out.view(t, self.o_groups, -1)).flatten(1))
