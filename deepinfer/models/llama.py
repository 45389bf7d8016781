"""Llama (and the shared decoder skeleton that Mistral and Qwen3 build on).

Shape legend:
    T   tokens in the flattened batch
    H   hidden size
    Hq  query heads, Hkv key/value heads, D head dim
    I   MLP intermediate size
    V   vocabulary size

Module names follow the HF checkpoint (``model.layers.N.self_attn.q_proj``, ...),
so the default ``CausalLM.load_weights`` maps tensors 1:1.

Tensor parallelism (``parallel/tensor.py``): built under a tensor-parallel group of size tp,
each rank keeps Hq/tp query and Hkv/tp key/value heads (q/k/v column-parallel, o_proj
row-parallel), I/tp of the MLP (gate/up column-, down row-parallel) and V/tp of the embedding
and LM head; at tp=1 the layers are plain ``nn.Linear`` / ``nn.Embedding``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.forward_context import ForwardContext
from deepinfer.layers.attention import Attention
from deepinfer.layers.mlp import GatedMLP
from deepinfer.layers.norm import RMSNorm
from deepinfer.layers.rotary import RotaryEmbedding, rope_parameters
from deepinfer.models.base import CausalLM, config_value
from deepinfer.parallel.groups import current_groups
from deepinfer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_divides,
)


@dataclass(frozen=True)
class DecoderArgs:
    """The config.json fields a Llama-style decoder reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str

    @classmethod
    def from_hf(cls, cfg: dict) -> "DecoderArgs":
        hidden = int(config_value(cfg, "hidden_size"))
        heads = int(config_value(cfg, "num_attention_heads"))
        return cls(
            vocab_size=int(config_value(cfg, "vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(config_value(cfg, "intermediate_size")),
            num_layers=int(config_value(cfg, "num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=str(cfg.get("hidden_act", "silu")),
        )


class LlamaAttention(nn.Module):
    """q/k/v projections, optional per-head q/k RMSNorm (Qwen3), rotary, attention, o_proj.
    Under tensor parallelism this rank's heads only (``num_heads`` = Hq/tp, ...)."""

    def __init__(self, args: DecoderArgs, dtype: torch.dtype, sliding_window: int | None,
                 qk_norm: bool = False) -> None:
        super().__init__()
        tp = current_groups().tp.size
        hq, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = hq // tp, hkv // tp, d
        self.q_proj = ColumnParallelLinear(args.hidden_size, hq * d, bias=args.attention_bias)
        self.k_proj = ColumnParallelLinear(args.hidden_size, hkv * d, bias=args.attention_bias)
        self.v_proj = ColumnParallelLinear(args.hidden_size, hkv * d, bias=args.attention_bias)
        self.o_proj = RowParallelLinear(hq * d, args.hidden_size, bias=args.attention_bias)
        if qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.qk_norm = qk_norm
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, scale=d ** -0.5, dtype=dtype,
                              sliding_window=sliding_window)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)      # [T, Hq, D]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)   # [T, Hkv, D]
        v = self.v_proj(x)                                             # [T, Hkv*D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply_qk(q, k, cos, sin)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, ctx)   # [T, Hq*D]
        return self.o_proj(out)                                        # [T, H]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h))."""

    def __init__(self, args: DecoderArgs, attn: LlamaAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: DecoderArgs, layers: list[nn.Module], rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.rotary_emb = rotary

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                               # [T, H]
        cos, sin = self.rotary_emb.cos_sin(ctx.positions)              # [T, D/2] each
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    """Llama 2/3: rope scaling default/linear/llama3, optional attention/MLP biases,
    tied or untied embeddings. Subclasses change per-layer choices through
    :meth:`sliding_window_for`, :meth:`make_attention` and :meth:`make_mlp`."""

    supports_cuda_graphs = True
    supports_context_parallel = True

    @classmethod
    def check_parallel(cls, hf_config: dict, tp: int) -> None:
        a = DecoderArgs.from_hf(hf_config)
        check_divides(tp, {"num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
                           "intermediate_size": a.intermediate_size, "vocab_size": a.vocab_size})

    def __init__(self, hf_config: dict, dtype: torch.dtype) -> None:
        super().__init__(hf_config, dtype)
        self.args = DecoderArgs.from_hf(hf_config)
        layers = [LlamaDecoderLayer(self.args, self.make_attention(i), self.make_mlp(i))
                  for i in range(self.args.num_layers)]
        rotary = RotaryEmbedding(self.args.head_dim, rope_parameters(hf_config))
        self.model = LlamaModel(self.args, layers, rotary)
        self.lm_head = self.make_lm_head(self.model.embed_tokens)

    def sliding_window_for(self, layer_idx: int) -> int | None:
        return None

    def make_attention(self, layer_idx: int) -> LlamaAttention:
        return LlamaAttention(self.args, self.dtype, self.sliding_window_for(layer_idx))

    def make_mlp(self, layer_idx: int) -> nn.Module:
        a = self.args
        return GatedMLP(a.hidden_size, a.intermediate_size, bias=a.mlp_bias, hidden_act=a.hidden_act)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # input_ids: [T] -> hidden: [T, H]
        return self.model(input_ids, ctx)
