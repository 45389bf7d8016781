"""DeepSeek-V4.1 attention: every layer's own sliding window plus a sparse selection of
a *shared* compressed KV stream, with learned sinks.

What differs from V4 (layers/deepseek_v4_attention.py), following mlx-lm's
``deepseek_v41`` (../shared/research/deepseek_v41.md):

- queries ``q = W_qb(RMSNorm(W_qa x))`` with no per-head RMS; one K=V row per token,
  ``kv = RMSNorm(W_kv x)``; RoPE on the trailing R channels (GPT-J pairs): base theta on
  window-only layers, the compress rope (YaRN, attention factor 1) on compressed layers;
- compressed KV is produced only by *KV-source* layers (ratio 2: each pair of tokens
  pooled with a per-channel 2-way softmax gate; ratio 1: every token's ``RMSNorm(W x)``)
  and read by the later layers of the same ratio (*reuse* layers) from the source's
  pages, never copied. An entry is the latent roped at its group's first token;
- an *index source* scores the entries' index keys (made by *key owners*, the KV sources
  that index: ``k_norm(W_k latent)`` roped like the entry) with its own queries and keeps
  the top ``index_topk`` visible entries; reuse layers take the nearest index source's
  selection. The *candidate source* also keeps, per query, the ``candidate_topk_blocks``
  best runs of ``candidate_block_size`` keys (the newest run always); *reindex* layers
  (index sources without keys) select only inside them;
- a query sees its layer's last ``sliding_window`` rows and its selected entries (no
  deduplication: at ratio 1 a recent token is both a window row and an entry);
- release KV formats (``round_kv``): window rows MXFP8 (the FP8 grid with a power-of-two
  scale per 32 channels), entries NVFP4 (E2M1, E4M3 scale per 16), index keys and index
  queries MXFP4 (E2M1, power-of-two scale per 32). With ``packed_kv`` the caches hold the
  release's packed records (uint8, kv_spec.py ``record_bytes``: 528 / 288 / 68 bytes at the
  release's sizes), encoded by the store (``backend.store_record``) and decoded by the kernels
  that read them; without, the rounded values are stored unpacked in the cache dtype (the CPU
  reference path). The queries are never cached: they are rounded in place.

The roles come from the config alone (:class:`V41LayerRole`, built by the model). One
forward passes a :class:`V41Shared` through the layers: a source layer publishes its
entry and key caches, an index layer its selection (and the candidate source its mask),
and later layers read them.

KV cache per layer: ``window_cache`` (sliding W, D; an MXFP8 record a row when packed); a
ratio-2 source adds a ``state_cache`` (sliding W: each token's projected kv and raw gate, so
the open pair is recomputed exactly after chunking, preemption or a prefix hit) and
``entry_cache`` (compressed, ratio 2; NVFP4 records when packed); a ratio-1 source's ``entry_cache`` is a
full cache (one entry per token); key owners add ``key_cache`` (MXFP4 records when packed)
beside the entries, in the same group, so a key's slot is its entry's slot. The state
cache is always values of the cache dtype.

Under context parallelism (``ctx.cp``, parallel/context.py) a rank's context holds its own
tokens: it gathers the step's window rows, latents (ratio 1) or pooling states (ratio 2)
from every rank and stores every entry and key of the step, so every rank keeps the whole
sequence's caches; its queries read them through its own context's slot tables.

Shapes: T tokens, Hd hidden, H heads, D head_dim, R rope dims, W window, N entry slots
per token (``ceil(max_seq_len / ratio)``), K selected entries, Hi/Di index heads/dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from deepinfer.forward_context import ForwardContext
from deepinfer.kernels import backend, reference
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.layers.deepseek_v4_attention import GroupedLinear, completing_tokens, PagedView, StepCaches
from deepinfer.layers.deepseek_v4_common import CacheSlot, InterleavedRope, RMSNorm
from deepinfer.layers.quant_linear import fp8_input
from deepinfer.parallel.groups import current_groups
from deepinfer.parallel.tensor import ColumnParallelLinear, RowParallelLinear, mark_shard


@dataclass(frozen=True)
class V41LayerRole:
    """What one layer does with the shared compressed stream (deepseek_v41.md §2)."""

    ratio: int                      # 0: window only; else the ratio of the stream it reads
    kv_source: bool                 # owns a compressor and the entries of its stream
    index_source: bool              # runs an indexer (its own top-k)
    key_owner: bool                 # a KV source that indexes: owns the index keys
    candidate_source: bool          # publishes candidate blocks (its own top-k unrestricted)
    entries_from: int | None        # the KV source whose entries it attends to
    keys_from: int | None           # index sources: the key owner whose keys it scores
    topk_from: int | None           # reuse layers: the index source whose selection it takes
    restricted: bool                # reindex: select only inside the candidate blocks

    @property
    def kind(self) -> str:
        if not self.ratio:
            return "window"
        if self.kv_source:
            return "source"
        if self.index_source:
            return "reindex"
        return "reuse"


@dataclass(frozen=True)
class DeepseekV41AttentionConfig:
    layer_idx: int
    role: V41LayerRole
    hidden_size: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rms_norm_eps: float
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_block_size: int
    candidate_topk_blocks: int
    cache_dtype: torch.dtype
    round_kv: bool
    packed_kv: bool = False         # round_kv stored as packed records (window, entries, keys)

    def __post_init__(self) -> None:
        if self.packed_kv and not self.round_kv:
            raise ValueError("packed_kv needs round_kv: the records hold the release's rounded formats")

    def kv_spec(self, kind: str, head_size: int, record: str, **kw) -> KVCacheSpec:
        """A one-tensor cache of ``head_size``-channel rows: ``record``s when packed, else values
        of the cache dtype."""
        if self.packed_kv:
            return KVCacheSpec(kind=kind, num_kv_heads=1, head_size=head_size, dtype=torch.uint8,
                               num_tensors=1, record=record, **kw)
        return KVCacheSpec(kind=kind, num_kv_heads=1, head_size=head_size, dtype=self.cache_dtype,
                           num_tensors=1, **kw)


_ROUND = {"mxfp8": reference.round_mxfp8, "nvfp4": reference.round_nvfp4, "mxfp4": reference.round_mxfp4}


def store_rows(view: PagedView, slot_mapping: torch.Tensor, x: torch.Tensor, fmt: str, round_kv: bool) -> None:
    """Store rows x [T, C] at their slots (-1: none) of a one-tensor cache: encoded as ``fmt``
    records in a record cache, else (rounded to ``fmt`` with ``round_kv``) as values."""
    if view.record is not None:
        if view.record != fmt:
            raise RuntimeError(f"a {view.record} record cache was handed {fmt} rows")
        backend.store_record(view.cache, slot_mapping, x, fmt)
        return
    if round_kv:
        x = _ROUND[fmt](x)
    backend.store_kv(view.cache, slot_mapping, x[:, None].to(view.cache.dtype))


@dataclass
class V41Shared:
    """What the layers of one forward publish for the later ones, by publishing layer."""

    entries: dict[int, PagedView] = field(default_factory=dict)
    keys: dict[int, PagedView] = field(default_factory=dict)
    selection: dict[int, torch.Tensor] = field(default_factory=dict)   # [T, K] entry slots, -1 none
    candidates: torch.Tensor | None = None                             # [T, N] bool


class V41Compressor(nn.Module):
    """A KV source's compressor: ratio 2 pools each pair of tokens
    (``sum softmax(gate) * kv`` per channel, in float32), ratio 1 takes each token; then
    ``kv_norm``. The latent (before RoPE) also feeds the index keys."""

    def __init__(self, cfg: DeepseekV41AttentionConfig) -> None:
        super().__init__()
        self.ratio = cfg.role.ratio
        self.kv_proj = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False) if self.ratio > 1 else None
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.state_cache = CacheSlot(KVCacheSpec(
            kind="sliding", num_kv_heads=1, head_size=cfg.head_dim, dtype=cfg.cache_dtype, num_tensors=2,
            sliding_window=max(cfg.sliding_window, self.ratio))) if self.ratio > 1 else None

    def latents(self, x: torch.Tensor, ctx: ForwardContext, caches: StepCaches
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(latents [M, D] in x's dtype, their sequence rows [M], the position of each
        group's first token [M]) of the groups this step completes. Ratio 1: every token.
        Ratio 2: stores every token's (kv, gate) in the state cache first, then pools the
        rows completing a pair (a ``decode_only`` context pools every row: M = T, and the
        caller stores those that complete nothing at slot -1). Under context parallelism the
        groups are the whole step's and the rows are those of ``ctx.cp.step``."""
        if self.ratio == 1:
            latent = self.kv_norm(self.kv_proj(x))
            if ctx.cp is not None:
                # A context-parallel share: the whole step's latents (every rank's rows, in
                # token order), each rank storing every entry (parallel/context.py).
                return ctx.cp.gather(latent), ctx.cp.step.token_seq, ctx.cp.step.positions
            return latent, ctx.token_seq, ctx.positions
        # Pooled in float32 (the projections accumulate in float32 in x's dtype's GEMM).
        kv, gate = self.kv_proj(x).float(), self.gate_proj(x).float()             # [T, D]
        state = caches.bind(self.state_cache)
        table = state.meta.block_table
        if ctx.cp is not None:
            # A context-parallel share stores the whole step's states and pools every pair the
            # step completes, over the step's context.
            kv, gate = ctx.cp.gather(torch.cat((kv, gate), dim=-1)).split(kv.shape[1], dim=-1)
            ctx = ctx.cp.step
            table = self.state_cache.meta(ctx).block_table
        backend.store_kv(state.cache, state.meta.slot_mapping, kv[:, None].to(state.cache.dtype),
                         gate[:, None].to(state.cache.dtype))
        seq, pos = ctx.token_seq, ctx.positions
        completing = completing_tokens(ctx, self.ratio)
        if completing is not None:
            seq, pos = completing
        pooled = backend.pool_window(state.cache, table, seq, pos, self.ratio)
        return self.kv_norm(pooled.to(x.dtype)), seq, pos + 1 - self.ratio

    def entry_index(self, pos: torch.Tensor) -> torch.Tensor:
        """[M] index of the entry completed by the token at ``pos`` (the group's last), -1 for none."""
        if self.ratio == 1:
            return pos
        return torch.where((pos + 1) % self.ratio == 0, (pos + 1) // self.ratio - 1, -1)


class V41Indexer(nn.Module):
    """Scores entries by ``sum_h w_h relu(q_h . k) / sqrt(Di)``, ``w = W_w x / sqrt(Hi)``."""

    def __init__(self, cfg: DeepseekV41AttentionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.index_topk = cfg.index_topk
        self.role = cfg.role
        self.block = cfg.candidate_block_size
        self.num_blocks = cfg.candidate_topk_blocks
        self.round = cfg.round_kv
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)
        if cfg.role.key_owner:
            self.k_proj = nn.Linear(cfg.head_dim, cfg.index_head_dim, bias=False)
            self.k_norm = RMSNorm(cfg.index_head_dim, cfg.rms_norm_eps)

    def keys(self, latent: torch.Tensor, first: torch.Tensor, rope: InterleavedRope) -> torch.Tensor:
        """Index keys [M, Di] of latents [M, D] whose groups start at ``first`` [M], before the
        MXFP4 rounding (the store applies it)."""
        return backend.interleaved_rope(self.k_norm(self.k_proj(latent))[:, None], first, rope.inv_freq,
                                        rope.scaling)[:, 0]

    def select(self, x: torch.Tensor, q_residual: torch.Tensor, ctx: ForwardContext, rope: InterleavedRope,
               keys: PagedView, slots: torch.Tensor, shared: V41Shared) -> torch.Tensor:
        """[T, min(topk, N)] entry slots each token attends to (-1 for none); the candidate
        source also publishes its candidate mask in ``shared``.

        slots: [T, N] the key cache's slots of entries ``0 .. N-1``, -1 where not yet visible.
        """
        t = x.shape[0]
        q = self.q_b_proj(q_residual).view(t, self.num_heads, self.head_dim)
        q = backend.interleaved_rope(q, ctx.positions, rope.inv_freq, rope.scaling)    # [T, Hi, Di]
        if self.round:
            q = reference.round_mxfp4(q)
        weights = self.weights_proj(x).float() * self.num_heads ** -0.5                # [T, Hi]
        # A decode_only context has one token a sequence: no keys to share between tokens.
        groups = None if ctx.decode_only else ctx.token_seq
        scores = backend.indexer_scores(q, weights, keys.cache, slots, self.head_dim ** -0.5, groups,
                                        keys.record)                                    # [T, N]
        if self.role.candidate_source:
            visible = (slots >= 0).sum(dim=1)
            shared.candidates = backend.candidate_block_mask(scores, visible, self.block, self.num_blocks)
        elif self.role.restricted:
            if shared.candidates is None:
                raise RuntimeError(f"reindex layer reads candidate blocks, but no candidate source ran before it")
            scores = scores.masked_fill(~shared.candidates, float("-inf"))
        return backend.topk_slots(scores, slots, self.index_topk)


class DeepseekV41Attention(nn.Module):
    def __init__(self, cfg: DeepseekV41AttentionConfig) -> None:
        super().__init__()
        self.layer_idx = cfg.layer_idx
        self.role = cfg.role
        # Tensor parallelism shards the heads and with them the output groups: q_b and
        # o_a (block-diagonal by group) keep this rank's, o_b sums the ranks' partial outputs.
        # The one shared KV head, the compressor and the indexer are every rank's.
        tp = current_groups().tp
        self.num_heads = cfg.num_heads // tp.size
        self.head_dim = cfg.head_dim
        self.o_groups = cfg.o_groups // tp.size
        self.sliding_window = cfg.sliding_window
        self.scale = cfg.head_dim ** -0.5
        self.round = cfg.round_kv
        self.rope_type = "compress" if cfg.role.ratio else "main"
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
        self.compressor = V41Compressor(cfg) if cfg.role.kv_source else None
        self.indexer = V41Indexer(cfg) if cfg.role.index_source else None
        self.window_cache = CacheSlot(cfg.kv_spec("sliding", cfg.head_dim, "mxfp8",
                                                  sliding_window=cfg.sliding_window))
        if cfg.role.kv_source:
            kind, ratio = ("full", 1) if cfg.role.ratio == 1 else ("compressed", cfg.role.ratio)
            self.entry_cache = CacheSlot(cfg.kv_spec(kind, cfg.head_dim, "nvfp4", compress_ratio=ratio))
            self.key_cache = CacheSlot(cfg.kv_spec(kind, cfg.index_head_dim, "mxfp4", compress_ratio=ratio)
                                       ) if cfg.role.key_owner else None

    def note_fp8_inputs(self) -> None:
        """With an FP8 q_b (and the indexer's, reading the same q_residual), the q_a norm
        quantises its output for them in its own launch (both then skip their act-quant)."""
        self.q_a_norm.fp8_out = fp8_input(self.q_b_proj)

    def fp8_input(self) -> tuple[int, bool] | None:
        """(group, pow2_scale) of the FP8 projections that read the block input x, or None."""
        return fp8_input(self.q_a_proj)

    def _publish(self, x: torch.Tensor, ctx: ForwardContext, caches: StepCaches, rope: InterleavedRope,
                 shared: V41Shared) -> None:
        """A KV source: compress this step's completed groups into entries (and index keys),
        store them, and publish the caches."""
        latent, seq, first = self.compressor.latents(x, ctx, caches)
        entries = caches.bind(self.entry_cache)
        index = self.compressor.entry_index(first + self.compressor.ratio - 1)
        # Under context parallelism the latents are the whole step's: their rows index its table.
        table = entries.meta.block_table if ctx.cp is None else self.entry_cache.meta(ctx.cp.step).block_table
        slot = reference.table_slots(table, entries.cache.shape[1], seq.long(), index[:, None])[:, 0]  # [M]
        entry = backend.interleaved_rope(latent[:, None].clone(), first, rope.inv_freq, rope.scaling)[:, 0]
        store_rows(entries, slot, entry, "nvfp4", self.round)
        shared.entries[self.layer_idx] = entries
        if self.key_cache is not None:
            keys = caches.bind(self.key_cache)
            store_rows(keys, slot, self.indexer.keys(latent, first, rope), "mxfp4", self.round)
            shared.keys[self.layer_idx] = keys

    def forward(self, x: torch.Tensor, ctx: ForwardContext, ropes: dict[str, InterleavedRope],
                caches: StepCaches, shared: V41Shared) -> torch.Tensor:
        # x: [T, Hd] (normed block input) -> [T, Hd]
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        role, rope, pos = self.role, ropes[self.rope_type], ctx.positions
        q_residual = self.q_a_norm(self.q_a_proj(x))                               # [T, q_lora]
        q = backend.interleaved_rope(self.q_b_proj(q_residual).view(t, h, d), pos, rope.inv_freq,
                                     rope.scaling)                                # [T, H, D]
        window = caches.bind(self.window_cache)
        kv = backend.kv_norm_rope(self.kv_proj(x), self.kv_norm.weight, pos, rope.inv_freq, rope.scaling,
                                  self.kv_norm.eps)                               # [T, D]
        # A context-parallel share stores the whole step's window rows (parallel/context.py).
        store_rows(window, window.meta.slot_mapping, kv if ctx.cp is None else ctx.cp.gather(kv), "mxfp8",
                   self.round)
        window_slots = window.slots(ctx, self.sliding_window, 1, sliding=True)     # [T, W]
        if ctx.window_floor is not None:
            # Column i holds position p - W + 1 + i; rows before the floor were never computed.
            first = pos - self.sliding_window + 1
            cols = torch.arange(self.sliding_window, device=pos.device)
            window_slots = window_slots.masked_fill(first[:, None] + cols[None, :] < ctx.window_floor[:, None], -1)
        sources, formats = [(window.cache, window_slots)], [window.record]
        if role.ratio:
            if role.kv_source:
                self._publish(x, ctx, caches, rope, shared)
            entries = shared.entries[role.entries_from]
            if role.index_source:
                keys = shared.keys[role.keys_from]
                n_max = max(1, -(-ctx.max_seq_len // role.ratio))
                slots = keys.slots(ctx, n_max, role.ratio, sliding=False)          # [T, N]
                shared.selection[self.layer_idx] = self.indexer.select(x, q_residual, ctx, rope, keys, slots,
                                                                       shared)
                selection = shared.selection[self.layer_idx]
            else:
                selection = shared.selection[role.topk_from]
            sources.append((entries.cache, selection))
            formats.append(entries.record)
        out = backend.sparse_attention(q, sources, self.sinks, self.scale, formats)  # [T, H, D]
        out = backend.interleaved_rope(out, pos, rope.inv_freq, rope.scaling, inverse=True)
        return self.o_b_proj(self.o_a_proj(out.view(t, self.o_groups, -1)).flatten(1))

    def cache_slots(self) -> list[CacheSlot]:
        slots = [self.window_cache]
        if self.compressor is not None:
            slots += [s for s in (self.compressor.state_cache, self.entry_cache, self.key_cache) if s is not None]
        return slots
