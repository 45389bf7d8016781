"""DeepSeek-V4.1 (V4.1-Flash): lagged hyper-connections, a shared compressed KV cache
read through per-layer roles, engram n-gram memory, and sqrt-softplus MoE.

Shape legend:
    T   tokens in the flattened batch
    n   hyper-connection streams (hc_mult)
    Hd  hidden size
    V   vocabulary size

Forward (deepseek_v41.md §3): the embedding fills the n streams; each layer

0. engram layers first add ``gate_s * value`` to every stream (layers/engram.py);
1. computes its attention connection's (pre, post, comb) from the streams, but the
   attention input collapses the streams with the *previous* sublayer's pre (the
   previous FFN's; stream 0 for layer 0): mHC is lagged by one sublayer;
2. expands the attention output into the streams with (post, comb);
3. the FFN connection likewise, its input collapsed with the attention's pre;
4. hands its FFN pre to the next layer.

The output is ``norm(collapse(streams, last FFN pre))`` (no ``hc_head``). Layer roles
(window only, KV source, key owner, index source, candidate source, reindex, reuse) come
from the config's ``compress_ratios``, ``kv_source_layer_ids``, ``index_source_layer_ids``
and ``candidate_source_layer_id`` (:func:`layer_roles`); no layer index is hard-coded.

Checkpoint: the release layout (``text_config`` flattened by ModelConfig), raw DeepSeek
names (``layers.L.attn.wq_a``, ``layers.L.ffn.experts.E.w1``, ``hc_attn_fn``, ``embed``,
``head``, ``norm``), FP8/FP4 weights dequantised on load (but for the engram tables kept in
host memory, which stay FP8: layers/engram.py). Vision tensors are skipped (the
model is served text-only); ``mtp.*`` tensors (the DSpark drafter) are kept as
:attr:`DeepseekV41ForCausalLM.drafter_tensors`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.kernels import backend
from deepinfer.kv_spec import KVCacheSpec
from deepinfer.layers.deepseek_v41_attention import (DeepseekV41Attention, DeepseekV41AttentionConfig,
                                                     V41LayerRole, V41Shared)
from deepinfer.layers.deepseek_v4_attention import StepCaches
from deepinfer.layers.deepseek_v4_common import CacheSlot, InterleavedRope, RMSNorm
from deepinfer.layers.deepseek_v4_moe import DeepseekV4MoE
from deepinfer.layers.engram import (Engram, EngramLayout, EngramRows, build_token_map, engram_hash_ids,
                                     table_in_host_memory)
from deepinfer.layers.hyper_connection import HyperConnection
from deepinfer.models.base import CausalLM, ParamSlice
from deepinfer.models.deepseek_v4 import BLOCK_RENAMES, FP8_LINEARS, FeatureCapture, remap_block_tensor
from deepinfer.models.loader import fp8_block_size
from deepinfer.models.quant import pair_scales
from deepinfer.parallel.tensor import check_divides
from deepinfer.transfer import to_device

logger = logging.getLogger(__name__)

# ModelArgs defaults of mlx-lm's deepseek_v41 (the release's values), for fields a config leaves out.
_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "head_dim": 512, "q_lora_rank": 1280, "qk_rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2304, "n_routed_experts": 384, "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "sliding_window": 128, "compress_ratios": (),
    "kv_source_layer_ids": (), "index_source_layer_ids": (), "compress_rope_theta": 160000.0,
    "candidate_source_layer_id": -1, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "rope_theta": 10000.0,
    "rope_scaling": None, "max_position_embeddings": 1048576, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6, "engram_layer_ids": (), "engram_num_embeddings": None, "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
    "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")


def layer_roles(cfg: dict) -> list[V41LayerRole]:
    """Each layer's role from the config alone (deepseek_v41.md §2), after checking the
    invariants the architecture relies on."""
    n = int(cfg["num_hidden_layers"])
    ratios = [int(r) for r in cfg["compress_ratios"]]
    if len(ratios) < n:
        raise ValueError(f"compress_ratios has {len(ratios)} entries; it needs one per layer "
                         f"(num_hidden_layers={n})")
    kv, index = set(cfg["kv_source_layer_ids"]), set(cfg["index_source_layer_ids"])
    cand, cand_blocks = int(cfg["candidate_source_layer_id"]), int(cfg["candidate_topk_blocks"])
    for key, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        bad = sorted(i for i in ids if not (0 <= i < n and ratios[i] in (1, 2)))
        if bad:
            raise ValueError(f"{key} lists layer(s) {bad} that are not compressed layers "
                             f"(compress_ratios 1 or 2) of the {n} layers")
    if kv - index:
        raise ValueError(f"kv_source_layer_ids {sorted(kv - index)} are not in index_source_layer_ids: "
                         "every KV source must also index, or a reuse layer would apply a selection "
                         "made over another stream")
    bad = sorted(set(ratios[:n]) - {0, 1, 2})
    if bad:
        raise ValueError(f"compress_ratios has {bad}; DeepSeek-V4.1 layers take 0, 1 or 2")
    restricted_possible = cand_blocks > 0 and 0 <= cand < n
    if cand >= 0 and cand_blocks > 0:
        if cand not in index:
            raise ValueError(f"candidate_source_layer_id={cand} is not an index source")
        capacity = (cand_blocks - 1) * int(cfg["candidate_block_size"]) + 1
        if capacity < int(cfg["index_topk"]):
            raise ValueError(f"candidate capacity (candidate_topk_blocks - 1) * candidate_block_size + 1 = "
                             f"{capacity} is below index_topk={cfg['index_topk']}: a reindex layer could "
                             "pick keys outside its candidate blocks")

    def last(match: Callable[[int], bool], upto: int) -> int | None:
        return max((j for j in range(upto + 1) if match(j)), default=None)

    roles = []
    for i in range(n):
        r = ratios[i]
        if not r:
            roles.append(V41LayerRole(0, False, False, False, False, None, None, None, False))
            continue
        entries_from = last(lambda j: j in kv and ratios[j] == r, i)
        if entries_from is None:
            raise ValueError(f"layer {i} reads a ratio-{r} stream, but no KV source of ratio {r} "
                             "is at or below it")
        any_source = last(lambda j: j in kv, i)
        if any_source != entries_from:
            raise ValueError(f"layer {i} (ratio {r}) would read layer {entries_from}'s entries, but the "
                             f"nearest KV source below it is layer {any_source} (ratio {ratios[any_source]})")
        is_index = i in index
        keys_from = last(lambda j: j in kv and j in index, i) if is_index else None
        topk_from = None if is_index else last(lambda j: j in index and ratios[j] == r, i)
        if not is_index and topk_from is None:
            raise ValueError(f"layer {i} reuses a selection, but no index source is at or below it")
        roles.append(V41LayerRole(
            ratio=r, kv_source=i in kv, index_source=is_index, key_owner=i in kv and is_index,
            candidate_source=i == cand and cand_blocks > 0, entries_from=entries_from, keys_from=keys_from,
            topk_from=topk_from, restricted=is_index and i not in kv and restricted_possible and cand < i))
    return roles


@dataclass(frozen=True)
class DeepseekV41Args:
    cfg: dict                       # the flattened text config with defaults filled in
    roles: tuple[V41LayerRole, ...]
    engram_layout: EngramLayout | None

    @classmethod
    def from_hf(cls, hf_config: dict) -> "DeepseekV41Args":
        cfg = {**_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
        if cfg["scoring_func"] not in ("sqrtsoftplus", "sigmoid"):
            raise NotImplementedError(f"scoring_func={cfg['scoring_func']!r} is not supported for "
                                      "DeepSeek-V4.1; supported: sqrtsoftplus, sigmoid")
        if not cfg["norm_topk_prob"]:
            raise NotImplementedError("norm_topk_prob=false is not supported for DeepSeek-V4.1")
        if int(cfg.get("n_shared_experts", 1)) != 1:
            raise NotImplementedError(f"n_shared_experts={cfg['n_shared_experts']}: DeepSeek-V4.1 has one")
        head_dim, rope_dim = int(cfg["head_dim"]), int(cfg["qk_rope_head_dim"])
        if rope_dim % 2 or not 0 < rope_dim <= min(head_dim, int(cfg["index_head_dim"])):
            raise ValueError(f"qk_rope_head_dim={rope_dim} must be even and at most head_dim and index_head_dim")
        engram = tuple(int(i) for i in cfg["engram_layer_ids"])
        bad = [i for i in engram if not 0 <= i < int(cfg["num_hidden_layers"])]
        if bad:
            raise ValueError(f"engram_layer_ids {bad} are not layers of the {cfg['num_hidden_layers']}")
        if engram and int(cfg["sliding_window"]) < int(cfg["engram_max_ngram_size"]):
            raise ValueError(f"sliding_window={cfg['sliding_window']} must be >= engram_max_ngram_size: "
                             "engram's token history lives in the window")
        cfg["engram_layer_ids"] = engram
        layout = EngramLayout.from_config(
            engram, int(cfg["engram_vocab_size"]), int(cfg["engram_n_heads"]), int(cfg["engram_max_ngram_size"]),
            int(cfg["engram_compressed_vocab_size"]), cfg["engram_num_embeddings"]) if engram else None
        return cls(cfg=cfg, roles=tuple(layer_roles(cfg)), engram_layout=layout)

    def __getattr__(self, key: str):
        if key == "cfg":
            raise AttributeError(key)
        try:
            return self.cfg[key]
        except KeyError:
            raise AttributeError(key) from None

    def rope_params(self) -> dict[str, dict]:
        prf = self.qk_rope_head_dim / self.head_dim
        scaling = dict(self.rope_scaling or {})
        compress = {"rope_type": "default", "rope_theta": self.compress_rope_theta, "partial_rotary_factor": prf}
        if scaling.get("rope_type", scaling.get("type")) == "yarn":
            # V4.1 uses YaRN's frequencies with attention factor 1 (mlx-lm: mscale 0).
            compress.update(rope_type="yarn", factor=float(scaling["factor"]), attention_factor=1.0,
                            original_max_position_embeddings=int(scaling.get(
                                "original_max_position_embeddings", self.max_position_embeddings)),
                            beta_fast=scaling.get("beta_fast", 32), beta_slow=scaling.get("beta_slow", 1))
        return {"main": {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": prf},
                "compress": compress}

    def attention_config(self, i: int, cache_dtype: torch.dtype, round_kv: bool,
                         packed_kv: bool) -> DeepseekV41AttentionConfig:
        return DeepseekV41AttentionConfig(
            layer_idx=i, role=self.roles[i], hidden_size=self.hidden_size, num_heads=self.num_attention_heads,
            head_dim=self.head_dim, q_lora_rank=self.q_lora_rank, o_groups=self.o_groups,
            o_lora_rank=self.o_lora_rank, rms_norm_eps=self.rms_norm_eps, sliding_window=self.sliding_window,
            index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim, index_topk=self.index_topk,
            candidate_block_size=self.candidate_block_size, candidate_topk_blocks=self.candidate_topk_blocks,
            cache_dtype=cache_dtype, round_kv=round_kv, packed_kv=packed_kv)


class DeepseekV41DecoderLayer(nn.Module):
    def __init__(self, args: DeepseekV41Args, i: int, cache_dtype: torch.dtype, round_kv: bool,
                 packed_kv: bool) -> None:
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.layer_idx = i
        self.self_attn = DeepseekV41Attention(args.attention_config(i, cache_dtype, round_kv, packed_kv))
        self.mlp = DeepseekV4MoE(d, args.moe_intermediate_size, args.n_routed_experts, args.num_experts_per_tok,
                                 args.scoring_func, args.routed_scaling_factor, args.swiglu_limit, None,
                                 gate_temp=float(args.gate_temp))
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.attn_hc = HyperConnection(args.hc_mult, d, args.hc_sinkhorn_iters, args.hc_eps, eps)
        self.ffn_hc = HyperConnection(args.hc_mult, d, args.hc_sinkhorn_iters, args.hc_eps, eps)
        self.engram: Engram | None = None
        if i in args.engram_layer_ids:
            k = args.engram_layer_ids.index(i)
            rows = int(args.engram_layout.primes[k].sum())
            self.engram = Engram(d, args.hc_mult, args.engram_max_ngram_size - 1, args.engram_n_heads,
                                 args.engram_head_dim, rows, eps,
                                 table_in_host=table_in_host_memory(rows, args.engram_head_dim))

    @staticmethod
    def _connect(hc: HyperConnection, streams: torch.Tensor, pre_in: torch.Tensor,
                 norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the block input: ``norm(collapse(streams, pre_in))``, and this connection's own
        pre, post, comb)."""
        return hc.lagged(streams, pre_in, norm.params())

    def note_fp8_inputs(self) -> None:
        """Each connection's collapse quantises the normalised block input for the FP8
        projections that read it (attention: q_a and kv; FFN: the shared expert's gate and up)."""
        self.attn_hc.fp8_out = self.self_attn.fp8_input()
        self.ffn_hc.fp8_out = self.mlp.fp8_input()

    def forward(self, streams: torch.Tensor, pre_mix: torch.Tensor | None, input_ids: torch.Tensor,
                ctx: ForwardContext, ropes: dict[str, InterleavedRope], caches: StepCaches, shared: V41Shared,
                engram_rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # streams: [T, n, Hd]; pre_mix: [T, n] float32 (None: stream 0); engram_rows: [T, C*E] this
        # layer's engram table rows -> (streams, this layer's FFN pre)
        if self.engram is not None:
            streams = self.engram(streams, engram_rows)
        if pre_mix is None:
            # The first layer's input is stream 0: a one-hot collapse, exact in float32.
            pre_mix = torch.zeros(streams.shape[:2], dtype=torch.float32, device=streams.device)
            pre_mix[:, 0] = 1.0
        x, attn_pre, attn_post, attn_comb = self._connect(self.attn_hc, streams, pre_mix, self.input_layernorm)
        x = self.self_attn(x, ctx, ropes, caches, shared)
        streams = backend.hc_post(x, streams, attn_post, attn_comb)
        x, ffn_pre, ffn_post, ffn_comb = self._connect(self.ffn_hc, streams, attn_pre,
                                                       self.post_attention_layernorm)
        x = self.mlp(x, input_ids)
        return backend.hc_post(x, streams, ffn_post, ffn_comb), ffn_pre


class DeepseekV41Model(nn.Module):
    def __init__(self, args: DeepseekV41Args, cache_dtype: torch.dtype, round_kv: bool, packed_kv: bool) -> None:
        super().__init__()
        self.hc_mult = args.hc_mult
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DeepseekV41DecoderLayer(args, i, cache_dtype, round_kv, packed_kv)
                                    for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        ropes = args.rope_params()
        self.rope_main = InterleavedRope(args.head_dim, ropes["main"], args.max_position_embeddings)
        self.rope_compress = InterleavedRope(args.head_dim, ropes["compress"], args.max_position_embeddings)
        self.engram_layout = args.engram_layout
        self.engram_history: CacheSlot | None = None
        if self.engram_layout is not None:
            layout = self.engram_layout
            # Each token's compressed id, split into three bytes (exact in any float cache
            # dtype): the hash of position p reads the ids of p-3 .. p from the window.
            self.engram_history = CacheSlot(KVCacheSpec(
                kind="sliding", num_kv_heads=1, head_size=3, dtype=cache_dtype, num_tensors=1,
                sliding_window=args.sliding_window))
            self.register_buffer("engram_token_map", torch.zeros(args.vocab_size, dtype=torch.long),
                                 persistent=False)
            for name, value in (("primes", layout.primes), ("offsets", layout.offsets),
                                ("multipliers", layout.multipliers)):
                # torch.tensor (not from_numpy) follows the device the model is built on.
                self.register_buffer(f"engram_{name}", torch.tensor(np.ascontiguousarray(value)),
                                     persistent=False)
            self.engram_pad = int(args.engram_pad_token_id)

    def _hash_ids(self, input_ids: torch.Tensor, ctx: ForwardContext, caches: StepCaches) -> torch.Tensor:
        """[T, n_engram_layers, cols] engram table rows of every token (engram_v41.md §3.3): the
        compressed ids of positions p, p-1, .. from the token history in the cache (stored first)."""
        layout = self.engram_layout
        cids = self.engram_token_map[input_ids]                                  # [T]
        history = caches.bind(self.engram_history)
        packed = torch.stack([cids >> 16, (cids >> 8) & 255, cids & 255], dim=-1).to(history.cache.dtype)
        # A context-parallel share stores the whole step's ids (parallel/context.py): a hash
        # reads the ids before its token, which another rank may hold.
        backend.store_kv(history.cache, history.meta.slot_mapping,
                         (packed if ctx.cp is None else ctx.cp.gather(packed))[:, None])
        g = layout.max_ngram
        slots = history.slots(ctx, g, 1, sliding=True).flip(1)                   # [T, g] positions p, p-1, ..
        cache = history.cache
        bs = cache.shape[1]
        safe = slots.clamp(min=0)
        rows = cache[torch.div(safe, bs, rounding_mode="floor"), safe % bs, 0, 0].long()   # [T, g, 3]
        ids = (rows[..., 0] << 16) | (rows[..., 1] << 8) | rows[..., 2]
        pad = self.engram_token_map[self.engram_pad]
        ids = torch.where(slots >= 0, ids, pad)
        return torch.stack([engram_hash_ids(ids, self.engram_primes[k], self.engram_offsets[k],
                                            self.engram_multipliers[k])
                            for k in range(len(layout.layer_ids))], dim=1)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, capture: FeatureCapture | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # input_ids: [T] -> (last streams [T, n, Hd], last FFN pre [T, n] float32); ``capture``:
        # also write DSpark's target features of the rows it asks for (FeatureCapture)
        cached = bool(ctx.groups) and self.layers[0].self_attn.window_cache.kv_cache is not None
        if not cached:
            for b, (q_len, seq_len) in enumerate(zip(ctx.query_lens, ctx.seq_lens)):
                if q_len != seq_len:
                    raise ValueError(f"sequence {b} has {q_len} new of {seq_len} tokens: without a KV "
                                     "cache each sequence must be given whole, from position 0")
        embeds = self.embed_tokens(input_ids)
        caches = StepCaches(ctx, cached, embeds)
        engram = None
        if self.engram_layout is not None:
            # Every engram layer's rows, looked up now (overlapped with the layers before them
            # when a table is in host memory).
            engram = EngramRows({i: self.layers[i].engram for i in self.engram_layout.layer_ids},
                                self._hash_ids(input_ids, ctx, caches))
        streams = embeds[:, None, :].expand(-1, self.hc_mult, -1)                 # [T, n, Hd]
        ropes = {"main": self.rope_main, "compress": self.rope_compress}
        shared, pre_mix = V41Shared(), None
        replay = _Replay.plan(ctx, cached) if self.late_start < len(self.layers) else None
        cap_rows = None if capture is None else capture.rows      # [R] asked rows' index in streams
        for layer in self.layers:
            if replay is not None and layer.layer_idx == self.late_start:
                if replay.empty:
                    break                    # this chunk lies wholly before the replay starts
                if capture is not None:
                    cap_rows = replay.index_of(cap_rows, streams.shape[0])
                early = streams
                ctx, caches = replay.ctx, StepCaches(replay.ctx, True, streams)
                replay.full_pre = pre_mix
                streams, pre_mix, input_ids = replay.take(streams), replay.take(pre_mix), replay.take(input_ids)
                if engram is not None:
                    engram.take(replay.rows)
                shared = replay.shared(shared)
            if capture is not None:
                capture.record(layer.layer_idx, streams, cap_rows)
            streams, pre_mix = layer(streams, pre_mix, input_ids, ctx, ropes, caches, shared,
                                     engram.pop(layer.layer_idx) if layer.engram is not None else None)
        if engram is not None:
            engram.finish()
        if capture is not None and (replay is None or not replay.empty):
            capture.record(len(self.layers), streams, cap_rows)
        if replay is not None and not replay.empty:
            # Rows the late layers skipped keep the early layers' output: nothing samples them
            # (the last prompt token is always replayed, prompt-logprob requests replay all).
            streams = early.index_copy(0, replay.rows, streams)
            pre_mix = replay.full_pre.index_copy(0, replay.rows, pre_mix)
        return streams, pre_mix

    @property
    def late_start(self) -> int:
        """The first layer after the last KV source: the layers bounded replay truncates."""
        sources = [layer.layer_idx for layer in self.layers if layer.self_attn.role.kv_source]
        return sources[-1] + 1 if sources else 0


@dataclass
class _Replay:
    """The tokens of one forward that the late layers compute under bounded replay: a
    sequence's new tokens at positions >= its ``replay_start`` (ForwardContext.replay_starts),
    as a sub-context whose windows start empty at the replay start."""

    ctx: ForwardContext
    rows: torch.Tensor                   # [T'] rows of the full batch
    empty: bool
    full_pre: torch.Tensor | None = None

    @classmethod
    def plan(cls, ctx: ForwardContext, cached: bool) -> "_Replay | None":
        starts = ctx.replay_starts
        if starts is None or not cached or not any(starts):
            return None
        q = ctx.query_start_loc
        rows, qsl = [], [0]
        for b, end in enumerate(ctx.seq_lens):
            n = q[b + 1] - q[b]
            skip = min(n, max(0, starts[b] - (end - n)))
            rows.append(np.arange(q[b] + skip, q[b + 1]))
            qsl.append(qsl[-1] + n - skip)
        device = ctx.positions.device
        idx = to_device(np.concatenate(rows).astype(np.int64), torch.int64, device)
        floors = to_device(np.asarray(starts, dtype=np.int64), torch.int64, device)
        token_seq = ctx.token_seq[idx]
        sub = ForwardContext(
            positions=ctx.positions[idx], query_start_loc=qsl, seq_lens=ctx.seq_lens,
            groups=[GroupMetadata(g.block_size, g.block_table, g.slot_mapping[idx]) for g in ctx.groups],
            query_start_loc_t=to_device(np.asarray(qsl, dtype=np.int32), torch.int32, device),
            seq_lens_t=ctx.seq_lens_t, token_seq=token_seq, max_seq_len=ctx.max_seq_len,
            window_floor=floors[token_seq.long()])
        return cls(ctx=sub, rows=idx, empty=qsl[-1] == 0)

    def take(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.index_select(0, self.rows)

    def index_of(self, rows: torch.Tensor, num_rows: int) -> torch.Tensor:
        """Rows [R] of the full batch (of ``num_rows``) -> their index among the replayed rows,
        -1 for rows not replayed."""
        where = torch.full((num_rows,), -1, dtype=torch.long, device=rows.device)
        where[self.rows] = torch.arange(self.rows.shape[0], device=rows.device)
        return where[rows]

    def shared(self, shared: V41Shared) -> V41Shared:
        """The early layers' publications restricted to the replayed rows (caches are shared)."""
        return V41Shared(entries=shared.entries, keys=shared.keys,
                         selection={i: self.take(s) for i, s in shared.selection.items()},
                         candidates=self.take(shared.candidates))


# DeepSeek's in-layer names -> ours, matched on whole dotted components: V4.1's compressor,
# indexer and engram, then the parts it shares with V4.
_LAYER_RENAMES = (
    ("attn.compressor.wkv", "self_attn.compressor.kv_proj"),
    ("attn.compressor.wgate", "self_attn.compressor.gate_proj"),
    ("attn.compressor.norm", "self_attn.compressor.kv_norm"),
    ("attn.indexer.wq_b", "self_attn.indexer.q_b_proj"),
    ("attn.indexer.weights_proj", "self_attn.indexer.weights_proj"),
    ("attn.indexer.wk", "self_attn.indexer.k_proj"),
    ("attn.indexer.k_norm", "self_attn.indexer.k_norm"),
    ("engram", "engram"),
) + BLOCK_RENAMES
_TOP_RENAMES = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
                "norm.weight": "model.norm.weight"}
_LAYER_NAME = re.compile(r"^layers\.(?P<idx>\d+)\.(?P<rest>.+)$")
_ENGRAM_TABLE_NAME = re.compile(r"^layers\.(?P<idx>\d+)\.engram\.embed\.(?P<part>weight|scale|weight_scale_inv)$")
# Image-only tensors: the engine serves the model text-only.
_VISION_PREFIXES = ("vision.", "aligner.", "image_")
_VISION_SUFFIXES = (".gate.bias_vl",)


class DeepseekV41ForCausalLM(CausalLM):
    kv_cache_dtypes = KV_CACHE_DTYPES
    # A decode_only forward takes no host data and never syncs: ratio-2 sources pool every row
    # (storing at slot -1 where no pair completes), selections and candidate blocks are
    # fixed-shape tensor ops over ceil(max_seq_len / ratio) entry slots.
    supports_cuda_graphs = True
    supports_context_parallel = True

    fp8_linears = FP8_LINEARS

    @classmethod
    def check_parallel(cls, hf_config: dict, tp: int) -> None:
        # Tensor parallelism shards the attention heads and output groups only.
        a = DeepseekV41Args.from_hf(hf_config)
        check_divides(tp, {"num_attention_heads": a.num_attention_heads, "o_groups": a.o_groups})

    def __init__(self, hf_config: dict, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
        super().__init__(hf_config, dtype)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported for DeepSeek-V4.1; "
                             f"supported: {', '.join(KV_CACHE_DTYPES)}")
        self.args = DeepseekV41Args.from_hf(hf_config)
        a = self.args
        # "auto": the release's KV formats. Where the Triton kernels run (CUDA, or the CPU
        # interpreter) the window rows, entries and index keys are the release's packed records;
        # on the torch reference path the same rounded values are stored unpacked in the compute
        # dtype. The decision follows the device the model is built on (loader: torch.device).
        # "bfloat16" / "float32": unrounded values in that dtype.
        round_kv = kv_cache_dtype == "auto"
        self.packed_kv = round_kv and backend.use_triton(torch.empty(0))
        cache_dtype = dtype if round_kv else getattr(torch, kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.model = DeepseekV41Model(a, cache_dtype, round_kv, self.packed_kv)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.drafter_tensors: dict[str, torch.Tensor] = {}

    # -- forward -------------------------------------------------------------------
    def head(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Streams [T, n, Hd] and the last FFN pre [T, n] -> hidden [T, Hd] for compute_logits."""
        return self.model.norm(backend.hc_collapse(streams, pre))

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                capture: FeatureCapture | None = None) -> torch.Tensor:
        return self.head(*self.model(input_ids, ctx, capture))

    def forward_rows(self, input_ids: torch.Tensor, ctx: ForwardContext,
                     select: Callable[[torch.Tensor], torch.Tensor],
                     capture: FeatureCapture | None = None) -> torch.Tensor:
        streams, pre = self.model(input_ids, ctx, capture)
        return self.head(select(streams), select(pre))

    def replay_keep_tokens(self, mode: str, keep: int) -> int | None:
        """SWA bounded replay: how many trailing prompt tokens the layers after the last KV
        source compute. Those layers see other tokens only through their windows and the
        sparse selection over the last source's entries (computed for every token), so
        ``exact`` keeps ``num_late_layers * sliding_window`` tokens, their whole receptive
        field (the output equals ``full``); ``compact`` keeps ``keep`` tokens, whose windows
        start empty at the replay start (DeepSeek's fast prefill; approximate). None: every
        layer computes every token."""
        window = int(self.args.sliding_window)
        num_late = len(self.model.layers) - self.model.late_start
        if mode == "full" or num_late == 0:
            return None
        if mode == "exact":
            return num_late * window
        if mode == "compact":
            # A decode step reads its window's last W rows: they must lie after the replay start.
            if keep < window:
                raise ValueError(f"yoco_prefill_keep_tokens={keep} is shorter than the sliding window "
                                 f"({window}): decode steps would read late-layer rows that were never "
                                 f"computed; use at least {window}")
            return keep
        raise ValueError(f"prefill truncation mode {mode!r} is not one of full, exact, compact")

    # -- assets and weights ----------------------------------------------------------
    def load_assets(self, path: str) -> None:
        """The engram token map, from the checkpoint's tokenizer.json (engram_v41.md §3.1)."""
        if self.model.engram_layout is None:
            return
        tokenizer = Path(path) / "tokenizer.json"
        if tokenizer.is_file():
            table = build_token_map(tokenizer)
        else:
            # A dummy-weight model (benchmarks) has no tokenizer: any fixed map serves.
            logger.info("no tokenizer.json in %s: engram hashes token ids modulo the compressed vocabulary",
                        path)
            table = np.arange(self.args.vocab_size) % int(self.args.engram_compressed_vocab_size)
        if table.max(initial=0) >= int(self.args.engram_compressed_vocab_size):
            raise ValueError(f"the tokenizer's engram map has {table.max() + 1} compressed ids, more than "
                             f"engram_compressed_vocab_size={self.args.engram_compressed_vocab_size}")
        n = min(len(table), self.args.vocab_size)
        self.model.engram_token_map[:n] = torch.as_tensor(table[:n], dtype=torch.long)

    def remap_weight_name(self, name: str) -> str | ParamSlice | None:
        if name in _TOP_RENAMES:
            return _TOP_RENAMES[name]
        m = _LAYER_NAME.match(name)
        if m is None:
            return name
        return remap_block_tensor(self, name, f"model.layers.{m['idx']}", m["rest"], _LAYER_RENAMES)

    def _host_table(self, name: str) -> tuple[int, str] | None:
        """(layer, "codes" or "scales") when checkpoint tensor ``name`` is part of an engram table
        kept in host memory."""
        m = _ENGRAM_TABLE_NAME.match(name)
        if m is None or int(m["idx"]) >= len(self.model.layers):
            return None
        engram = self.model.layers[int(m["idx"])].engram
        if engram is None or not engram.embed.in_host_memory:
            return None
        return int(m["idx"]), "codes" if m["part"] == "weight" else "scales"

    def keeps_quantized(self, name: str) -> bool:
        """The host-memory engram tables and their scales, and the shipped tensors of layers kept in
        the checkpoint's formats: kept as the checkpoint stores them."""
        return self._host_table(name) is not None or super().keeps_quantized(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the release layout: vision tensors skipped (one log line), ``mtp.*`` kept in
        :attr:`drafter_tensors`, FP8/FP4 tensors dequantised with their scales, except the
        engram tables kept in host memory, which keep their FP8 codes and scales as given
        (mapped from the file by the loader) and are pinned for the model's device."""
        skipped = 0
        host_tables: dict[int, dict[str, torch.Tensor]] = {
            i: {} for i, layer in enumerate(self.model.layers)
            if layer.engram is not None and layer.engram.embed.in_host_memory}

        def text_only() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped
            for name, tensor in weights:
                table = self._host_table(name)
                if table is not None:
                    if table[1] in host_tables[table[0]]:
                        raise ValueError(f"checkpoint tensor {name!r}: the {table[1]} of layer {table[0]}'s "
                                         "engram table are given twice")
                    host_tables[table[0]][table[1]] = tensor
                elif name.startswith(_VISION_PREFIXES) or name.endswith(_VISION_SUFFIXES):
                    skipped += 1
                elif name.startswith("mtp."):
                    self.drafter_tensors[name] = tensor
                else:
                    yield name, tensor

        # The release's blocks are 32 x 32 (its quantization_config); a config naming others wins.
        block = fp8_block_size(self.args.cfg, default=32)
        super().load_weights(pair_scales(text_only(), fp8_block=block, keep=self.keeps_quantized))
        if skipped:
            logger.info("skipped %d vision tensor(s): DeepSeek-V4.1 is served text-only", skipped)
        device = self.lm_head.weight.device
        for i, parts in host_tables.items():
            name = f"layers.{i}.engram.embed"
            if "codes" not in parts or "scales" not in parts:
                given = f" (given: {name}.weight, {parts['codes'].dtype})" if "codes" in parts else ""
                raise ValueError(f"checkpoint is missing the FP8 engram table of layer {i} that "
                                 f"{type(self).__name__} keeps in host memory: {name}.weight (float8_e4m3fn) "
                                 f"and {name}.scale (E8M0){given}; DEEPINFER_ENGRAM_TABLES=device dequantises "
                                 "a table of any dtype onto the device instead")
            self.model.layers[i].engram.embed.set_fp8(parts["codes"], parts["scales"], device, name)
