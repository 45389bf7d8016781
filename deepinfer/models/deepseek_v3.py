"""DeepSeek-V3: MLA attention, "noaux_tc" sigmoid MoE with shared experts, and MTP.

Shape legend:
    T   tokens in the flattened batch
    H   hidden size
    E   routed experts in G groups (n_group); K experts per token (num_experts_per_tok)
    I   expert intermediate size (moe_intermediate_size)
    V   vocabulary size

Layers ``0 .. first_k_dense_replace-1`` use a dense SwiGLU MLP, the others a
MoE block (layers/moe.py experts, grouped sigmoid routing, plus shared experts).
Attention is MLA (layers/mla.py), whose cache holds one latent per token.

The checkpoint's ``model.layers.{num_hidden_layers + k}.*`` tensors are the k-th
multi-token-prediction (MTP) module, which HF drops. Here they load into
:class:`DeepseekV3MTP` at ``model.mtp`` (a runnable drafter for speculative
decoding); a checkpoint without them loads with ``model.mtp = None``.
Module names follow the checkpoint, so the default ``CausalLM.load_weights``
maps tensors 1:1 (per-expert tensors into the stacked expert weights).

DeepSeek ships V3 in FP8 (``X.weight`` float8_e4m3fn with per-128x128-tile
``X.weight_scale_inv``); such weights are dequantised as they load
(models/quant.py), and plain checkpoints pass through unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.forward_context import ForwardContext
from deepinfer.kernels import backend
from deepinfer.layers.mla import MLAConfig, MLARotaryEmbedding, MLAttention
from deepinfer.layers.mlp import GatedMLP
from deepinfer.layers.moe import FusedMoE
from deepinfer.layers.norm import RMSNorm
from deepinfer.models.base import CausalLM, ParamSlice, config_value
from deepinfer.models.llama import DecoderArgs, LlamaDecoderLayer, LlamaModel
from deepinfer.models.quant import pair_scales
from deepinfer.parallel.tensor import check_divides

_LAYER_NAME = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
# Parts of an MTP module outside its decoder block (checkpoint names).
_MTP_OWN_PARTS = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


@dataclass(frozen=True)
class MoEArgs:
    """The config.json fields of DeepSeek-V3's MoE blocks (HF's defaults where absent)."""

    hidden_size: int
    num_experts: int
    num_shared_experts: int
    top_k: int
    num_groups: int
    topk_groups: int
    intermediate_size: int
    renormalize: bool
    routed_scaling_factor: float
    hidden_act: str

    @classmethod
    def from_hf(cls, cfg: dict) -> "MoEArgs":
        for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if cfg.get(key, supported) != supported:
                raise NotImplementedError(f"{key}={cfg[key]!r} is not supported; DeepseekV3ForCausalLM "
                                          f"routes with {key}={supported!r}")
        if cfg.get("moe_layer_freq", 1) != 1:
            raise NotImplementedError(f"moe_layer_freq={cfg['moe_layer_freq']} is not supported; "
                                      "every layer from first_k_dense_replace on is MoE")
        args = cls(
            hidden_size=int(config_value(cfg, "hidden_size")),
            num_experts=int(config_value(cfg, "n_routed_experts")),
            num_shared_experts=int(cfg.get("n_shared_experts") or 0),
            top_k=int(config_value(cfg, "num_experts_per_tok")),
            num_groups=int(cfg.get("n_group", 8)),
            topk_groups=int(cfg.get("topk_group", 4)),
            intermediate_size=int(config_value(cfg, "moe_intermediate_size")),
            renormalize=bool(cfg.get("norm_topk_prob", True)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
        )
        e, g = args.num_experts, args.num_groups
        if g < 1 or e % g or e // g < 2:
            raise ValueError(f"n_routed_experts={e} must split into n_group={g} groups of at least "
                             "2 experts each (a group ranks by its two best experts)")
        if not 1 <= args.topk_groups <= g:
            raise ValueError(f"topk_group={args.topk_groups} must be in [1, n_group={g}]")
        if not 1 <= args.top_k <= args.topk_groups * (e // g):
            raise ValueError(f"num_experts_per_tok={args.top_k} must be in [1, topk_group * "
                             f"n_routed_experts / n_group = {args.topk_groups * (e // g)}]")
        return args


class NoAuxTCRouter(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k (``backend.grouped_topk_sigmoid``).

    The weight and the correction bias stay float32: routing runs in float32,
    as in HF and DeepSeek's reference.
    """

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias",
                             torch.zeros(args.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, K] float32, ids [T, K] int64
        a = self.args
        logits = backend.router_logits(x, self.weight)                 # [T, E] float32
        return backend.grouped_topk_sigmoid(logits, self.e_score_correction_bias, a.num_groups,
                                              a.topk_groups, a.top_k, a.renormalize,
                                              a.routed_scaling_factor)


class DeepseekV3MoE(nn.Module):
    """Routed experts plus always-on shared experts (one SwiGLU of I * n_shared_experts)."""

    def __init__(self, args: MoEArgs) -> None:
        super().__init__()
        self.gate = NoAuxTCRouter(args)
        if args.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={args.hidden_act!r} is not supported for "
                                      "experts; only 'silu' is")
        self.experts = FusedMoE(args.num_experts, args.hidden_size, args.intermediate_size)
        self.shared_experts = (
            GatedMLP(args.hidden_size, args.intermediate_size * args.num_shared_experts)
            if args.num_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = self.gate(x)                                    # [T, K] each
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def _decoder_layer(args: DecoderArgs, mla: MLAConfig, moe: MoEArgs | None,
                   dtype: torch.dtype) -> LlamaDecoderLayer:
    """Pre-norm block with MLA attention and a MoE (``moe`` given) or dense MLP."""
    mlp = (DeepseekV3MoE(moe) if moe is not None
           else GatedMLP(args.hidden_size, args.intermediate_size, hidden_act=args.hidden_act))
    return LlamaDecoderLayer(args, MLAttention(mla, dtype), mlp)


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 (and V3-architecture checkpoints such as R1 and V3.1).

    ``with_mtp=False`` skips building the MTP module (its tensors are then
    skipped on load, as HF does).
    """

    # The projections kept in FP8 (models/quantize.py): attention and MLPs, not kv_b_proj (absorbed
    # MLA decode reads its weight directly) nor the MTP's vocabulary head.
    fp8_linears = (r"self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|o_proj)$"
                   r"|(mlp|shared_experts)\.(gate_proj|up_proj|down_proj)$|eh_proj$")

    # Decode is graph-safe: absorbed MLA over device-side lengths (layers/mla.py), Triton routing
    # and experts sized from T alone.
    supports_cuda_graphs = True
    supports_context_parallel = True

    @classmethod
    def check_parallel(cls, hf_config: dict, tp: int) -> None:
        # MLA heads, the dense and shared-expert MLPs and the vocabulary shard; routed experts
        # stay whole under tensor parallelism (expert parallelism splits them).
        moe = MoEArgs.from_hf(hf_config)
        check_divides(tp, {"num_attention_heads": int(config_value(hf_config, "num_attention_heads")),
                           "intermediate_size": int(config_value(hf_config, "intermediate_size")),
                           "moe_intermediate_size * n_shared_experts": moe.intermediate_size * moe.num_shared_experts,
                           "vocab_size": int(config_value(hf_config, "vocab_size"))})

    def __init__(self, hf_config: dict, dtype: torch.dtype, with_mtp: bool = True) -> None:
        super().__init__(hf_config, dtype)
        self.args = DecoderArgs.from_hf(hf_config)
        self.mla = MLAConfig.from_hf(hf_config)
        self.moe = MoEArgs.from_hf(hf_config)
        first_moe = int(hf_config.get("first_k_dense_replace", 3))
        layers = [_decoder_layer(self.args, self.mla, self.moe if i >= first_moe else None, dtype)
                  for i in range(self.args.num_layers)]
        rotary = MLARotaryEmbedding(self.mla.qk_rope_head_dim, self.mla.rope)
        self.model = LlamaModel(self.args, layers, rotary)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)
        # HF's default is one MTP module when config.json does not say.
        num_mtp = int(hf_config.get("num_nextn_predict_layers", 1))
        self.mtp = DeepseekV3MTP(hf_config, dtype) if with_mtp and num_mtp > 0 else None

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, H] (final norm applied; also the MTP's input)
        return self.model(input_ids, ctx)

    def kv_cache_layers(self) -> list[nn.Module]:
        """The main layers' MLA modules; the MTP's are ``self.mtp.kv_cache_layers()``."""
        return [layer.self_attn for layer in self.model.layers]

    def remap_weight_name(self, name: str) -> str | ParamSlice | None:
        if _mtp_index(name, self.args.num_layers) is not None:
            return None
        return super().remap_weight_name(name)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the main model (strictly, as ``CausalLM.load_weights``), then the MTP
        tensors into ``self.mtp``; with none in the checkpoint, ``self.mtp`` becomes None.

        The MTP tensors (one decoder layer per module) are held until the main
        weights are in, so that the stream is read once.
        """
        if self.mtp is None:
            super().load_weights(dequantized(weights, self.hf_config, self.keeps_quantized))
            return
        # Held as stored (FP8 stays FP8 until the MTP loads).
        mtp_weights: list[tuple[str, torch.Tensor]] = []

        def main_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if _mtp_index(name, self.args.num_layers) is None:
                    yield name, tensor
                else:
                    mtp_weights.append((name, tensor))

        # Detached while the main weights load, so their strict completeness check
        # does not count the (optional) MTP parameters.
        mtp = self._modules.pop("mtp")
        try:
            super().load_weights(dequantized(main_weights(), self.hf_config, self.keeps_quantized))
        finally:
            self.mtp = mtp
        if mtp_weights:
            self.mtp.load_weights(mtp_weights)
        else:
            self.mtp = None


class DeepseekV3MTPLayer(nn.Module):
    """One MTP module: ``h' = block(eh_proj([enorm(embed(t_next)), hnorm(h)]))``;
    logits ``shared_head.head(shared_head.norm(h'))``."""

    def __init__(self, args: DecoderArgs, mla: MLAConfig, moe: MoEArgs, dtype: torch.dtype) -> None:
        super().__init__()
        h = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, h)
        self.enorm = RMSNorm(h, args.rms_norm_eps)
        self.hnorm = RMSNorm(h, args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # MTP blocks are MoE whatever first_k_dense_replace says (as in HF and DeepSeek).
        self.block = _decoder_layer(args, mla, moe, dtype)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, args.rms_norm_eps)
        self.shared_head.head = nn.Linear(h, args.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # input_ids: [T]; previous_hidden: [T, H] -> [T, H]
        e = self.enorm(self.embed_tokens(input_ids))                   # [T, H]
        h = self.hnorm(previous_hidden)                                # [T, H]
        return self.block(self.eh_proj(torch.cat((e, h), dim=-1)), cos, sin, ctx)


class DeepseekV3MTP(CausalLM):
    """DeepSeek-V3's multi-token-prediction modules as a runnable drafter.

    Module k reads, for each token, the embedding of the *next* token and the
    previous stage's hidden state at this token (the main model's final-normed
    hidden for k = 0, module k-1's output after) and predicts the token after
    that. Which positions and cache slots a step uses is the caller's choice,
    given through ``ctx`` as for the main model. Loads from the whole checkpoint
    stream (it skips everything but ``model.layers.{N + k}.*``).
    """

    def __init__(self, hf_config: dict, dtype: torch.dtype) -> None:
        super().__init__(hf_config, dtype)
        self.args = DecoderArgs.from_hf(hf_config)
        self.mla = MLAConfig.from_hf(hf_config)
        num_mtp = int(hf_config.get("num_nextn_predict_layers", 1))
        if num_mtp < 1:
            raise ValueError(f"num_nextn_predict_layers={num_mtp}: this checkpoint has no MTP module")
        moe = MoEArgs.from_hf(hf_config)
        self.layers = nn.ModuleList(DeepseekV3MTPLayer(self.args, self.mla, moe, dtype)
                                    for _ in range(num_mtp))
        self.rotary_emb = MLARotaryEmbedding(self.mla.qk_rope_head_dim, self.mla.rope)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, previous_hidden: torch.Tensor,
                step: int = 0) -> torch.Tensor:
        """input_ids [T] (the next tokens), previous_hidden [T, H] -> hidden [T, H] of module ``step``."""
        cos, sin = self.rotary_emb.cos_sin(ctx.positions)              # [T, Dr/2] each
        return self.layers[step](input_ids, previous_hidden, cos, sin, ctx)

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        # hidden: [N, H] -> [N, V] float32
        head = self.layers[step].shared_head
        return head.head(head.norm(hidden)).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(dequantized(weights, self.hf_config, self.keeps_quantized))

    def remap_weight_name(self, name: str) -> str | ParamSlice | None:
        k = _mtp_index(name, self.args.num_layers)
        if k is None:
            return None
        rest = _LAYER_NAME.match(name)["rest"]
        part = rest if rest.startswith(_MTP_OWN_PARTS) else f"block.{rest}"
        return super().remap_weight_name(f"layers.{k}.{part}")


def dequantized(weights: Iterable[tuple[str, torch.Tensor]], hf_config: dict,
                keep: Callable[[str], bool] | None = None) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint stream with FP8 weights dequantised (float32) and their scales
    consumed, per config.json's ``quantization_config`` (128x128 tiles by default); tensors
    named so that ``keep(name)`` is true pass as stored."""
    quant = hf_config.get("quantization_config") or {}
    method = quant.get("quant_method", "fp8")
    if method != "fp8":
        raise NotImplementedError(f"quantization_config.quant_method={method!r} is not supported; "
                                  "only DeepSeek's block-scaled 'fp8' is")
    rows, cols = quant.get("weight_block_size", (128, 128))
    if rows != cols:
        raise NotImplementedError(f"quantization_config.weight_block_size={[rows, cols]} is not "
                                  "supported; only square tiles are")
    return pair_scales(weights, fp8_block=int(rows), keep=keep)


def _mtp_index(name: str, num_layers: int) -> int | None:
    """k for checkpoint tensors of MTP module k (``model.layers.{num_layers + k}.*``), else None."""
    m = _LAYER_NAME.match(name)
    if m is None or int(m["layer"]) < num_layers:
        return None
    return int(m["layer"]) - num_layers
