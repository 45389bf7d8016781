"""Mixture-of-experts building blocks: a softmax top-k router and stacked SwiGLU experts.

Expert weights are stacked per projection (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I], the layout HF transformers 5 keeps in memory and a
grouped-GEMM kernel wants). Checkpoints that store one tensor per expert
(``experts.{e}.gate_proj.weight``) load into slices of them; see
:meth:`FusedMoE.expert_weight_index` and ``CausalLM.remap_weight_name``.

Both run through ``kernels/backend.py``: the pure-PyTorch references on the CPU,
the fused Triton kernels (``kernels/moe_routing.py``, ``kernels/fused_moe.py``) on
CUDA, which never synchronise with the host (CUDA-graph safe).

Shapes: T tokens, H hidden, E experts, K experts per token, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.kernels import backend


class SoftmaxTopKRouter(nn.Module):
    """Router logits ``x @ weight.T``, softmax, top-k (optionally renormalised)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> weights [T, K] float32, ids [T, K] int64
        logits = F.linear(x, self.weight)                         # [T, E]
        return backend.softmax_topk(logits, self.top_k, self.renormalize)


class FusedMoE(nn.Module):
    """E SwiGLU experts applied to the tokens routed to them, outputs weighted and summed."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; topk_weights, topk_ids: [T, K] -> [T, H]
        return backend.moe_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)

    def expert_weight_index(self, proj: str, expert: int) -> tuple[str, tuple[int | slice, ...]]:
        """Where one expert's ``{proj}.weight`` lives: (parameter name, index into it)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} is out of range: this layer has "
                             f"num_experts={self.num_experts}")
        i = self.intermediate_size
        if proj == "gate_proj":
            return "gate_up_proj", (expert, slice(0, i))
        if proj == "up_proj":
            return "gate_up_proj", (expert, slice(i, 2 * i))
        if proj == "down_proj":
            return "down_proj", (expert,)
        raise ValueError(f"unknown expert projection {proj!r}; expected gate_proj, up_proj or down_proj")
