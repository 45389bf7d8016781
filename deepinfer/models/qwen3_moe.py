"""Qwen3-MoE: Qwen3 attention with sparse MoE feed-forward blocks.

Shape legend:
    T   tokens in the flattened batch
    H   hidden size
    E   routed experts, K experts per token (num_experts_per_tok)
    I   expert intermediate size (moe_intermediate_size)
    V   vocabulary size

Layer i is sparse when ``i`` is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; other layers use a dense SwiGLU MLP of
``intermediate_size``. Routing: softmax over E, top-K, renormalised when
``norm_topk_prob``. With ``use_sliding_window`` every layer slides (as in HF).
Checkpoints store one tensor per expert (``mlp.experts.{e}.gate_proj.weight``)
or HF's stacked ``mlp.experts.gate_up_proj``; both load (see layers/moe.py).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.layers.moe import FusedMoE, SoftmaxTopKRouter
from deepinfer.models.base import config_value
from deepinfer.models.llama import LlamaAttention, LlamaForCausalLM
from deepinfer.models.qwen3 import sliding_window


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.gate = SoftmaxTopKRouter(hidden_size, num_experts, top_k, renormalize)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        weights, ids = self.gate(x)                                    # [T, K] each
        return self.experts(x, weights, ids)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def sliding_window_for(self, layer_idx: int) -> int | None:
        return sliding_window(self.hf_config)

    def make_attention(self, layer_idx: int) -> LlamaAttention:
        return LlamaAttention(self.args, self.dtype, self.sliding_window_for(layer_idx), qk_norm=True)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        cfg = self.hf_config
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step", 1))
        sparse = (layer_idx not in (cfg.get("mlp_only_layers") or [])
                  and num_experts > 0 and (layer_idx + 1) % step == 0)
        if not sparse:
            return super().make_mlp(layer_idx)
        if self.args.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={self.args.hidden_act!r} is not supported for "
                                      "experts; only 'silu' is")
        return Qwen3MoeSparseMoeBlock(
            hidden_size=self.args.hidden_size, num_experts=num_experts,
            top_k=int(config_value(cfg, "num_experts_per_tok")),
            intermediate_size=int(config_value(cfg, "moe_intermediate_size")),
            renormalize=bool(cfg.get("norm_topk_prob", False)))
