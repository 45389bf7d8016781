"""Gated (SwiGLU) feed-forward block with HF parameter names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GatedMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; x: [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={hidden_act!r} is not supported; only 'silu' is")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
