"""RMSNorm over the last dimension (Llama/Qwen/DeepSeek style)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import backend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., D] -> [..., D]
        return backend.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
