"""DeepSeek-V4 (V4-Flash / V4-Pro): hyper-connected decoder with sliding-window,
CSA and HCA attention, hash-routed and sqrtsoftplus MoE, and MTP layers.

Shape legend:
    T   tokens in the flattened batch
    n   hyper-connection streams (hc_mult)
    Hd  hidden size
    V   vocabulary size

Forward: ``embed -> n copies -> [HC(attn) -> HC(MoE)] x L -> hc_head -> norm``;
logits ``lm_head(hidden)``. Layer types come from ``layer_types`` (or DeepSeek's
``compress_ratios``: 0 sliding, 4 CSA, 128 HCA; entries past the last layer
describe the MTP layers), MoE types from ``mlp_layer_types`` (or the first
``num_hash_layers`` hash-routed). Numerics match HF transformers' ``deepseek_v4``.

MTP (speculative decoding): :meth:`DeepseekV4ForCausalLM.mtp_forward` runs MTP
layer k on the main model's pre-head streams at positions p and the embeddings
of the tokens at p+1 (same ``ctx`` positions p), giving hidden states whose
logits predict the tokens at p+2. MTP layers have KV caches of their own, so
they must see every position of a sequence. A checkpoint without any ``mtp.*``
tensors (HF transformers drops them) loads without MTP layers. A checkpoint whose config
has ``dspark_block_size`` (V4-Flash-0731, V4-Flash-DSpark) ships a DSpark drafter as its
``mtp.*`` (models/dspark.py): it gets no MTP layer, its ``mtp.*`` tensors are kept in
``drafter_tensors``, and the forward captures the drafter's target features
(:class:`FeatureCapture`).

Checkpoint names: HF's (``model.layers.N.self_attn.q_a_proj.weight``,
stacked ``mlp.experts.gate_up_proj``) and DeepSeek's own
(``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.weight``,
``hc_attn_fn``, ``mtp.0.*``), with FP8/FP4 weights and their ``.scale`` tensors
dequantised on load (models/quant.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.forward_context import ForwardContext
from deepinfer.kernels import backend
from deepinfer.kv_spec import ds_mla_format
from deepinfer.layers.deepseek_v4_attention import (CSA, HCA, LAYER_TYPES, SLIDING, DeepseekV4Attention,
                                                    DeepseekV4AttentionConfig)
from deepinfer.layers.deepseek_v4_common import InterleavedRope, RMSNorm
from deepinfer.layers.deepseek_v4_moe import DeepseekV4MoE, DeepseekV4SharedExpert
from deepinfer.layers.hyper_connection import HyperConnection, HyperHead
from deepinfer.models.base import OTHER_RANK, CausalLM, OtherRank, ParamSlice
from deepinfer.models.quant import pair_scales
from deepinfer.parallel.tensor import check_divides

# DeepseekV4Config's defaults (transformers 5.23), for fields a config.json leaves out.
_HF_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "max_position_embeddings": 1048576,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
    "hc_eps": 1.0e-6, "swiglu_limit": 10.0, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "num_nextn_predict_layers": 1,
    "hidden_act": "silu", "rms_norm_eps": 1.0e-6,
    "attention_bias": False, "mlp_bias": False,
}
_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
# kv_cache_dtype: "auto" stores the KV in the compute dtype (HF's numerics); "fp8" rounds window
# rows and compressed entries as DeepSeek's reference stores them (kv_spec.py ds_mla_format).
KV_CACHE_DTYPES = ("auto", "fp8")
_DEFAULT_NUM_HASH_LAYERS = 3


def has_dspark(hf_config: dict) -> bool:
    """Whether a config ships a DSpark drafter (its ``mtp.*`` tensors): ``dspark_block_size`` is set."""
    return hf_config.get("dspark_block_size") is not None


def text_config(hf_config: dict) -> dict:
    """The config with DeepseekV4Config's defaults filled in (what models/dspark.py reads)."""
    return {**_HF_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}


@dataclass(frozen=True)
class DeepseekV4Args:
    """The HF config resolved the way ``DeepseekV4Config.__post_init__`` resolves it."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_mtp_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rms_norm_eps: float
    n_routed_experts: int
    top_k: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    sliding_window: int
    layer_types: tuple[str, ...]       # main layers, then MTP layers
    mlp_layer_types: tuple[str, ...]   # "hash_moe" | "moe", main layers then MTP layers
    compress_rates: dict
    rope_parameters: dict              # {"main": {...}, "compress": {...}}
    max_position_embeddings: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    fp8_block: int

    @classmethod
    def from_hf(cls, hf_config: dict) -> "DeepseekV4Args":
        cfg = text_config(hf_config)
        n, m = int(cfg["num_hidden_layers"]), int(cfg["num_nextn_predict_layers"])
        if has_dspark(cfg):
            # The mtp.* blocks of a DSpark checkpoint (V4-Flash-0731 / -DSpark) are its DSpark
            # drafter (models/dspark.py), not MTP layers: a prefix-remapping MTP loader would
            # half-load them, so no MTP layer is built.
            m = 0
        for key, want in (("num_key_value_heads", 1), ("n_shared_experts", 1), ("hidden_act", "silu"),
                          ("attention_bias", False), ("mlp_bias", False)):
            if cfg[key] != want:
                raise NotImplementedError(f"{key}={cfg[key]!r} is not supported for DeepSeek-V4; "
                                          f"only {want!r} is")

        rates = dict(cfg.get("compress_rates") or _DEFAULT_COMPRESS_RATES)
        for legacy, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if cfg.get(legacy) is not None:
                rates[layer_type] = int(cfg[legacy])
        layer_types = cfg.get("layer_types")
        if layer_types is None and cfg.get("compress_ratios") is not None:
            by_ratio = {0: SLIDING, rates[CSA]: CSA, rates[HCA]: HCA}
            bad = [r for r in cfg["compress_ratios"] if r not in by_ratio]
            if bad:
                raise ValueError(f"compress_ratios has {bad}; each entry must be one of {sorted(by_ratio)}")
            layer_types = [by_ratio[r] for r in cfg["compress_ratios"]]
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        if len(layer_types) < n or any(t not in LAYER_TYPES for t in layer_types):
            raise ValueError(f"layer_types/compress_ratios must give one of {LAYER_TYPES} for each of the "
                             f"num_hidden_layers={n} layers; got {list(layer_types)}")
        # Entries past the main layers describe the MTP layers (DeepSeek's compress_ratios).
        mtp_types = list(layer_types[n:n + m]) + [SLIDING] * (m - len(layer_types[n:n + m]))

        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = cfg.get("num_hash_layers", _DEFAULT_NUM_HASH_LAYERS)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        mlp_types = list(mlp_types[:n])
        if len(mlp_types) != n or any(t not in ("hash_moe", "moe") for t in mlp_types):
            raise ValueError(f"mlp_layer_types must give 'hash_moe' or 'moe' for each of the {n} layers; "
                             f"got {mlp_types}")

        head_dim = int(cfg["head_dim"])
        prf = cfg.get("partial_rotary_factor")
        if prf is None:
            prf = cfg["qk_rope_head_dim"] / head_dim if cfg.get("qk_rope_head_dim") is not None else 64 / 512
        rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            rope = {"main": dict(rp["main"]), "compress": dict(rp["compress"])}
        else:
            # YaRN (when configured) applies to the compressed layers' rope only.
            compress = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            compress.update(rope_theta=cfg["compress_rope_theta"], partial_rotary_factor=prf)
            compress["rope_type"] = compress.get("rope_type", compress.get("type", "default"))
            if compress["rope_type"] == "yarn":
                compress.setdefault("attention_factor", 1.0)
            rope = {"main": {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                             "partial_rotary_factor": prf},
                    "compress": compress}
        # The compress rope also rotates the indexer's queries and keys.
        limits = {"main": head_dim, "compress": min(head_dim, int(cfg["index_head_dim"]))}
        for kind, params in rope.items():
            dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
            if dim % 2 or not 0 < dim <= limits[kind]:
                raise ValueError(f"the {kind} rope rotates {dim} channels (head_dim * "
                                 f"partial_rotary_factor); that must be even and in [2, {limits[kind]}]")

        block = (cfg.get("quantization_config") or {}).get("weight_block_size", [128, 128])
        if len(set(block)) != 1:
            raise NotImplementedError(f"quantization_config.weight_block_size={block}: only square "
                                      "FP8 blocks are supported")
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]), num_layers=n, num_mtp_layers=m,
            num_heads=int(cfg["num_attention_heads"]), head_dim=head_dim, q_lora_rank=int(cfg["q_lora_rank"]),
            o_groups=int(cfg["o_groups"]), o_lora_rank=int(cfg["o_lora_rank"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]), n_routed_experts=int(cfg["n_routed_experts"]),
            top_k=int(cfg["num_experts_per_tok"]), scoring_func=cfg["scoring_func"],
            routed_scaling_factor=float(cfg["routed_scaling_factor"]),
            swiglu_limit=float(cfg["swiglu_limit"]), sliding_window=int(cfg["sliding_window"]),
            layer_types=tuple(layer_types[:n]) + tuple(mtp_types),
            mlp_layer_types=tuple(mlp_types) + ("moe",) * m,
            compress_rates=rates, rope_parameters=rope,
            max_position_embeddings=int(cfg["max_position_embeddings"]),
            hc_mult=int(cfg["hc_mult"]), hc_sinkhorn_iters=int(cfg["hc_sinkhorn_iters"]),
            hc_eps=float(cfg["hc_eps"]), index_n_heads=int(cfg["index_n_heads"]),
            index_head_dim=int(cfg["index_head_dim"]), index_topk=int(cfg["index_topk"]),
            fp8_block=int(block[0]))

    def rope_dim(self, layer_idx: int) -> int:
        """Channels the layer's rope rotates ("main" on sliding layers, "compress" otherwise):
        its window rows' and entries' RoPE part."""
        kind = "main" if self.layer_types[layer_idx] == SLIDING else "compress"
        return int(self.head_dim * self.rope_parameters[kind].get("partial_rotary_factor", 1.0))

    def attention_config(self, layer_idx: int, cache_dtype: torch.dtype, fp8_kv: bool = False,
                         packed_kv: bool = False) -> DeepseekV4AttentionConfig:
        layer_type = self.layer_types[layer_idx]
        return DeepseekV4AttentionConfig(
            hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
            q_lora_rank=self.q_lora_rank, o_groups=self.o_groups, o_lora_rank=self.o_lora_rank,
            rms_norm_eps=self.rms_norm_eps, sliding_window=self.sliding_window, layer_type=layer_type,
            compress_ratio=self.compress_rates.get(layer_type, 0), index_n_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim, index_topk=self.index_topk, cache_dtype=cache_dtype,
            kv_record=ds_mla_format(self.rope_dim(layer_idx)) if fp8_kv else None, packed_kv=packed_kv)


class DeepseekV4Rope(nn.Module):
    """The two rope types: "main" (sliding layers) and "compress" (CSA/HCA layers, compressors, indexers)."""

    def __init__(self, args: DeepseekV4Args) -> None:
        super().__init__()
        self.main = InterleavedRope(args.head_dim, args.rope_parameters["main"], args.max_position_embeddings)
        self.compress = InterleavedRope(args.head_dim, args.rope_parameters["compress"],
                                        args.max_position_embeddings)

    def by_type(self) -> dict[str, InterleavedRope]:
        return {"main": self.main, "compress": self.compress}


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, args: DeepseekV4Args, layer_idx: int, dtype: torch.dtype, fp8_kv: bool = False,
                 packed_kv: bool = False) -> None:
        super().__init__()
        d, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = DeepseekV4Attention(args.attention_config(layer_idx, dtype, fp8_kv, packed_kv))
        hash_vocab = args.vocab_size if args.mlp_layer_types[layer_idx] == "hash_moe" else None
        self.mlp = DeepseekV4MoE(d, args.moe_intermediate_size, args.n_routed_experts, args.top_k,
                                 args.scoring_func, args.routed_scaling_factor, args.swiglu_limit, hash_vocab)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.attn_hc = HyperConnection(args.hc_mult, d, args.hc_sinkhorn_iters, args.hc_eps, eps)
        self.ffn_hc = HyperConnection(args.hc_mult, d, args.hc_sinkhorn_iters, args.hc_eps, eps)

    def note_fp8_inputs(self) -> None:
        """Each connection's collapse quantises the normalised block input for the FP8
        projections that read it (attention: q_a and kv; FFN: the shared expert's gate and up)."""
        self.attn_hc.fp8_out = self.self_attn.fp8_input()
        self.ffn_hc.fp8_out = self.mlp.fp8_input()

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, ctx: ForwardContext,
                ropes: dict[str, InterleavedRope]) -> torch.Tensor:
        # streams: [T, n, Hd] -> [T, n, Hd]. Each connection applies its block's input norm
        # (x comes back normalised: the kernel fuses the norm into the collapse).
        x, post, comb = self.attn_hc(streams, norm=self.input_layernorm.params())   # x: [T, Hd]
        x = self.self_attn(x, ctx, ropes)
        streams = self.attn_hc.expand(x, streams, post, comb)
        x, post, comb = self.ffn_hc(streams, norm=self.post_attention_layernorm.params())
        x = self.mlp(x, input_ids)
        return self.ffn_hc.expand(x, streams, post, comb)


class DeepseekV4MTPLayer(DeepseekV4DecoderLayer):
    """A decoder layer fed ``e_proj(enorm(embed(next token))) + h_proj(hnorm(streams))``,
    with its own head mixing (``hc_head``) and final norm."""

    def __init__(self, args: DeepseekV4Args, layer_idx: int, dtype: torch.dtype, fp8_kv: bool = False,
                 packed_kv: bool = False) -> None:
        super().__init__(args, layer_idx, dtype, fp8_kv, packed_kv)
        d = args.hidden_size
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.enorm = RMSNorm(d, args.rms_norm_eps)
        self.hnorm = RMSNorm(d, args.rms_norm_eps)
        self.norm = RMSNorm(d, args.rms_norm_eps)
        self.hc_head = HyperHead(args.hc_mult, d, args.hc_eps, args.rms_norm_eps)

    def forward(self, streams: torch.Tensor, embeds: torch.Tensor, input_ids: torch.Tensor,
                ctx: ForwardContext, ropes: dict[str, InterleavedRope]) -> torch.Tensor:
        # streams: [T, n, Hd], embeds: [T, Hd] -> [T, n, Hd]
        x = self.e_proj(self.enorm(embeds)).unsqueeze(1) + self.h_proj(self.hnorm(streams))
        return super().forward(x, input_ids, ctx, ropes)

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        # [T, n, Hd] -> [T, Hd]
        return self.norm(self.hc_head(streams))


class DeepseekV4Model(nn.Module):
    def __init__(self, args: DeepseekV4Args, dtype: torch.dtype, fp8_kv: bool = False,
                 packed_kv: bool = False) -> None:
        super().__init__()
        self.hc_mult = args.hc_mult
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(args, i, dtype, fp8_kv, packed_kv)
                                    for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.hc_head = HyperHead(args.hc_mult, args.hidden_size, args.hc_eps, args.rms_norm_eps)
        self.rotary_emb = DeepseekV4Rope(args)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                capture: FeatureCapture | None = None) -> torch.Tensor:
        # input_ids: [T] -> pre-head streams [T, n, Hd]; ``capture``: also write DSpark's
        # target features of the rows it asks for (FeatureCapture)
        # The n streams start as n copies of the embedding, left as a view (stream stride 0):
        # the first connection's kernels read the one row n times, bit for bit what they read
        # from n written copies, and its hc_post writes the first materialised streams.
        streams = self.embed_tokens(input_ids)[:, None, :].expand(-1, self.hc_mult, -1)     # [T, n, Hd]
        ropes = self.rotary_emb.by_type()
        for i, layer in enumerate(self.layers):
            if capture is not None:
                capture.record(i, streams, capture.rows)
            streams = layer(streams, input_ids, ctx, ropes)
        if capture is not None:
            capture.record(len(self.layers), streams, capture.rows)
        return streams


@dataclass
class FeatureCapture:
    """A forward's request for DSpark target features (models/dspark.py): for each asked row,
    the mean of the n streams *entering* each of ``layer_ids`` (``num_hidden_layers``: the
    final streams, before the head's collapse), concatenated in that order into ``out``
    [R, M*Hd], which the forward writes in place (a fixed buffer: CUDA-graph replays write it
    again; no host sync). DeepSeek-V4 (capture-after ids) asks for its ids + 1.

    Bounded replay (DeepSeek-V4.1): the layers from ``late_start`` on compute only each
    sequence's replayed rows (positions >= its ``replay_start``), so a row asked of such a
    layer must be a replayed one; a row that is not gets zeros there. DSpark reads the last
    ``sliding_window`` committed positions, which replay always covers
    (``replay_keep_tokens`` keeps at least a window), so the rows to ask are at most the last
    window of each sequence's new tokens.
    """

    layer_ids: tuple[int, ...]
    rows: torch.Tensor                  # [R] int64 rows of the flattened batch
    out: torch.Tensor                   # [R, M*Hd]

    @classmethod
    def new(cls, layer_ids: tuple[int, ...], rows: torch.Tensor, hidden_size: int,
            dtype: torch.dtype) -> "FeatureCapture":
        return cls(tuple(layer_ids), rows, torch.zeros(rows.shape[0], len(layer_ids) * hidden_size,
                                                       dtype=dtype, device=rows.device))

    def record(self, layer_idx: int, streams: torch.Tensor, rows: torch.Tensor) -> None:
        """streams [T', n, Hd] entering layer ``layer_idx``; rows [R] each asked row's index in
        them (-1: not computed here)."""
        if layer_idx not in self.layer_ids:
            return
        d = streams.shape[-1]
        k = self.layer_ids.index(layer_idx)
        mean = streams.index_select(0, rows.clamp(min=0)).float().mean(dim=1)           # [R, Hd]
        self.out[:, k * d:(k + 1) * d] = torch.where(rows[:, None] >= 0, mean, 0.0).to(self.out.dtype)


# DeepSeek's in-layer names of the parts V4 and V4.1 share -> ours (HF's), matched on whole
# dotted components.
BLOCK_RENAMES = (
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a", "self_attn.q_a_proj"),
    ("attn.q_norm", "self_attn.q_a_norm"),
    ("attn.wq_b", "self_attn.q_b_proj"),
    ("attn.wkv", "self_attn.kv_proj"),
    ("attn.kv_norm", "self_attn.kv_norm"),
    ("attn.wo_a", "self_attn.o_a_proj"),
    ("attn.wo_b", "self_attn.o_b_proj"),
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.shared_experts.w1", "mlp.shared_experts.gate_proj"),
    ("ffn.shared_experts.w3", "mlp.shared_experts.up_proj"),
    ("ffn.shared_experts.w2", "mlp.shared_experts.down_proj"),
)
# V4's own, then the shared ones, in order (the indexer's compressor before the layer's).
_LAYER_RENAMES = (
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.wkv", "self_attn.compressor.indexer.kv_proj"),
    ("attn.indexer.compressor.wgate", "self_attn.compressor.indexer.gate_proj"),
    ("attn.indexer.compressor.norm", "self_attn.compressor.indexer.kv_norm"),
    ("attn.indexer.wq_b", "self_attn.compressor.indexer.q_b_proj"),
    ("attn.indexer.weights_proj", "self_attn.compressor.indexer.scorer.weights_proj"),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.wkv", "self_attn.compressor.kv_proj"),
    ("attn.compressor.wgate", "self_attn.compressor.gate_proj"),
    ("attn.compressor.norm", "self_attn.compressor.kv_norm"),
    # HF's save_pretrained writes the kv norm back as ``attn.norm`` (its load rule
    # renames ``.norm.`` to ``.kv_norm.``).
    ("attn.norm", "self_attn.kv_norm"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    # MTP layers only
    ("hc_head_fn", "hc_head.hc_fn"), ("hc_head_base", "hc_head.hc_base"),
    ("hc_head_scale", "hc_head.hc_scale"),
) + BLOCK_RENAMES
_TOP_RENAMES = {
    "embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale",
}
# The projections DeepSeek ships in FP8 in V4 and V4.1 (models/quantize.py): the attention's q_a,
# q_b, kv, o_a (grouped: Fp8Linear with groups) and o_b, the indexer's q_b and the shared expert.
# The compressors and the indexer's other projections stay 16-bit, as do lm_head and the routers.
FP8_LINEARS = (r"self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|(compressor\.)?indexer\.q_b_proj)$"
               r"|shared_experts\.(gate_proj|up_proj|down_proj)$")
_LAYER_NAME = re.compile(r"^(?:model\.)?(?P<kind>layers|mtp)\.(?P<idx>\d+)\.(?P<rest>.+)$")
_EXPERT_NAME = re.compile(r"^(?:ffn|mlp)\.experts\.(?P<expert>\d+)\."
                          r"(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def remap_block_tensor(model: nn.Module, name: str, prefix: str, rest: str,
                       renames: tuple[tuple[str, str], ...]) -> str | ParamSlice | OtherRank:
    """Where checkpoint tensor ``name`` (``rest`` inside the block at ``prefix``) goes in a
    DeepSeek-V4 / V4.1 model: a routed expert's matrix into the stacked experts, else the
    first of ``renames`` matching whole dotted components, else the name unchanged;
    ``OTHER_RANK`` for a routed expert another expert-parallel rank holds."""
    expert = _EXPERT_NAME.match(rest)
    if expert is not None:
        try:
            experts = model.get_submodule(f"{prefix}.mlp.experts")
            where = experts.expert_weight_index(
                _EXPERT_PROJ.get(expert["proj"], expert["proj"]), int(expert["expert"]))
        except (AttributeError, ValueError) as err:
            raise ValueError(f"checkpoint tensor {name!r}: {err}") from None
        return OTHER_RANK if where is None else ParamSlice(f"{prefix}.mlp.experts.{where[0]}", where[1])
    for native, ours in renames:
        if rest == native or rest.startswith(native + "."):
            return f"{prefix}.{ours}{rest[len(native):]}"
    return f"{prefix}.{rest}"


class DeepseekV4ForCausalLM(CausalLM):
    optional_modules = ("mtp",)
    kv_cache_dtypes = KV_CACHE_DTYPES
    # Attention, MoE and hyper-connections never sync in decode_only steps (Triton backend).
    supports_cuda_graphs = True
    supports_context_parallel = True

    fp8_linears = FP8_LINEARS

    @classmethod
    def check_parallel(cls, hf_config: dict, tp: int) -> None:
        # Tensor parallelism shards the attention heads and output groups only.
        a = DeepseekV4Args.from_hf(hf_config)
        check_divides(tp, {"num_attention_heads": a.num_heads, "o_groups": a.o_groups})

    def __init__(self, hf_config: dict, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> None:
        super().__init__(hf_config, dtype)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported for DeepSeek-V4; "
                             f"supported: {', '.join(KV_CACHE_DTYPES)}")
        self.args = DeepseekV4Args.from_hf(hf_config)
        a = self.args
        # "fp8": DeepSeek's FP8 KV entries. Where the Triton kernels run (CUDA, or the CPU
        # interpreter) the window rows and compressed entries are packed records; on the torch
        # reference path the same rounded values are stored unpacked in the compute dtype. The
        # decision follows the device the model is built on (loader: torch.device).
        fp8_kv = kv_cache_dtype == "fp8"
        if fp8_kv:
            for i in range(a.num_layers + a.num_mtp_layers):
                ds_mla_format(a.rope_dim(i))           # a rope width the record can carry
        self.packed_kv = fp8_kv and backend.use_triton(torch.empty(0))
        self.kv_cache_dtype = kv_cache_dtype
        self.model = DeepseekV4Model(a, dtype, fp8_kv, self.packed_kv)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)
        self.mtp = nn.ModuleList(DeepseekV4MTPLayer(a, a.num_layers + i, dtype, fp8_kv, self.packed_kv)
                                 for i in range(a.num_mtp_layers))
        # A DSpark checkpoint's mtp.* tensors, kept as loaded for the drafter
        # (models/dspark.py DSparkDrafter.from_target); no MTP layer is built for them.
        self.has_dspark = has_dspark(hf_config)
        self.drafter_tensors: dict[str, torch.Tensor] = {}

    # -- forward -------------------------------------------------------------------
    def forward_streams(self, input_ids: torch.Tensor, ctx: ForwardContext,
                        capture: FeatureCapture | None = None) -> torch.Tensor:
        """input_ids [T] -> the last layer's streams [T, n, Hd] (before hc_head), as MTP takes them;
        ``capture``: DSpark's target features too (FeatureCapture)."""
        return self.model(input_ids, ctx, capture)

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """Streams [T, n, Hd] -> hidden states [T, Hd] for :meth:`compute_logits`."""
        return self.model.norm(self.model.hc_head(streams))

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.head(self.forward_streams(input_ids, ctx))

    def forward_rows(self, input_ids: torch.Tensor, ctx: ForwardContext,
                     select: Callable[[torch.Tensor], torch.Tensor],
                     capture: FeatureCapture | None = None) -> torch.Tensor:
        """The head mixing and the final norm on the selected rows' streams only: at a
        4,096-token prefill that samples one row they took 117 us over all rows (H200)."""
        return self.head(select(self.forward_streams(input_ids, ctx, capture)))

    def mtp_forward(self, streams: torch.Tensor, next_ids: torch.Tensor, ctx: ForwardContext,
                    k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer k: streams [T, n, Hd] at positions p (``ctx``), next_ids [T] the tokens at p+1
        -> (hidden [T, Hd] for compute_logits, predicting p+2; the layer's output streams [T, n, Hd])."""
        if self.has_dspark:
            raise NotImplementedError("this checkpoint's mtp.* tensors are a DSpark drafter (its config has "
                                      "dspark_block_size), not MTP layers: use speculative_config method='dspark'")
        if not 0 <= k < len(self.mtp):
            raise ValueError(f"MTP layer {k} does not exist: this model has {len(self.mtp)} MTP layer(s)")
        layer = self.mtp[k]
        out = layer(streams, self.model.embed_tokens(next_ids), next_ids, ctx,
                    self.model.rotary_emb.by_type())
        return layer.head(out), out

    # -- weights -------------------------------------------------------------------
    def after_load(self) -> None:
        """Fuse the projections that read the same input (attention: q_a, kv, compressor
        and indexer; shared expert: gate and up) into one GEMM each. The parameters become
        views of the fused buffers (memory is not doubled; names and state_dict unchanged);
        see layers/fused_linear.py for what happens when weights are reloaded. Then the
        default's packing of the routed experts (``CausalLM.after_load``)."""
        for module in self.modules():
            if isinstance(module, (DeepseekV4Attention, DeepseekV4SharedExpert)):
                module.fuse_projections()
        super().after_load()

    def remap_weight_name(self, name: str) -> str | ParamSlice | None:
        if name in _TOP_RENAMES:
            return _TOP_RENAMES[name]
        m = _LAYER_NAME.match(name)
        if m is None:
            return name
        prefix = f"model.layers.{m['idx']}" if m["kind"] == "layers" else f"mtp.{m['idx']}"
        return remap_block_tensor(self, name, prefix, m["rest"], _LAYER_RENAMES)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF- or DeepSeek-named tensors, dequantising FP8/FP4 ones with their scales
        (the loader already does; direct callers may pass a raw checkpoint stream), except those
        the model keeps as shipped (:meth:`keeps_quantized`). A DSpark checkpoint's ``mtp.*``
        tensors are kept in :attr:`drafter_tensors` (any still quantised with their scales,
        paired when the drafter loads them)."""
        if self.has_dspark:
            weights = self._keep_drafter_tensors(weights)
        super().load_weights(pair_scales(weights, fp8_block=self.args.fp8_block, keep=self.keeps_quantized))

    def _keep_drafter_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]
                              ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            m = _LAYER_NAME.match(name)
            if m is not None and m["kind"] == "mtp":
                self.drafter_tensors[name.removeprefix("model.")] = tensor
            else:
                yield name, tensor
