"""Gated (SwiGLU) feed-forward block with HF parameter names.

Under a tensor-parallel group (``parallel/tensor.py``) each rank keeps I/tp of the intermediate
features: gate/up are column-parallel, down is row-parallel (its all-reduce makes the output whole).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.parallel.tensor import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``; x: [T, H] -> [T, H]."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act != "silu":
            raise NotImplementedError(f"hidden_act={hidden_act!r} is not supported; only 'silu' is")
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
