"""A bias-free ``nn.Linear`` computed through ``kernels/backend.py``.

Same parameter (``weight`` [out, in]), same ``state_dict`` as ``nn.Linear``; only the
forward differs: :func:`backend.linear` runs the Triton GEMV at decode sizes (at most
16 rows of x, on CUDA), which streams the weight once, and ``F.linear`` otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import backend


class Linear(nn.Linear):
    """``x @ weight.T``: x [..., in] -> [..., out], no bias."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backend.linear(x, self.weight)
