"""A bias-free linear layer whose weight stays in FP8 as DeepSeek ships it.

What belongs here: the module holding an e4m3 weight [N, K] and its block scales
[ceil(N/bn), K/bk] (float32, or UE8M0 exponent bytes as ``uint8``), and its forward through
``kernels/backend.py``: the Triton FP8 GEMM on CUDA (``kernels/fp8_gemm.py``: activations
quantised per 1 x ``group`` token group on the fly), the pure-PyTorch reference elsewhere (the
same arithmetic, dequantising per call: correct, slow, for tests). What does not: deciding which
layers are quantised (``models/quantize.py``).

The activation scales follow the weight's: float32 for float32 weight scales, powers of two for
UE8M0 ones (DeepSeek's ``scale_fmt``).

Shapes: T tokens, K input width, N output width.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels import backend
from deepinfer.models.quant import SCALE_FORMATS, dequant_fp8_block, quant_fp8_block

# The activations' token-group width (DeepSeek's kernels: 1 x 128).
ACT_GROUP = 128


def act_group(in_features: int) -> int | None:
    """The activation group for an input width: 128, or for a narrower input (tiny test models)
    the largest power of two >= 32 dividing it; None if there is none."""
    for group in (ACT_GROUP, 64, 32):
        if in_features % group == 0:
            return group
    return None


def fp8_input(linear: nn.Module) -> tuple[int, bool] | None:
    """(activation group, UE8M0-style power-of-two scales) with which ``linear`` quantises its
    input if it is an ungrouped :class:`Fp8Linear`, else None: what a kernel producing that input
    passes as ``fp8`` to quantise it in its own launch (``kernels/backend.attach_fp8``)."""
    if isinstance(linear, Fp8Linear) and linear.groups == 1:
        return linear.group, linear.scale_format == "ue8m0"
    return None


class Fp8Linear(nn.Module):
    """``y = x @ dequant(weight, scale)^T`` with weight e4m3 [N, K] and one scale per
    ``block`` = (bn, bk) tile. Its parameters (``weight``, ``scale``) never require grad.

    ``groups`` > 1: a block-diagonal projection like ``GroupedLinear`` (DeepSeek-V4's ``wo_a``),
    the g groups' [N / g, K] matrices stacked on the weight's rows (as the checkpoint ships them):
    x [..., g, K] -> [..., g, N / g]."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int] = (128, 128),
                 scale_format: str = "float32", groups: int = 1) -> None:
        super().__init__()
        if groups < 1 or out_features % groups or (groups > 1 and (out_features // groups) % 16):
            raise ValueError(f"Fp8Linear: groups={groups} must divide out_features={out_features} into groups "
                             "of a multiple of 16 rows")
        self.groups = groups
        if scale_format not in SCALE_FORMATS:
            raise ValueError(f"Fp8Linear: scale_format={scale_format!r} is not one of {SCALE_FORMATS}")
        bn, bk = block
        group = act_group(in_features)
        if group is None or in_features % bk or min(group, bk) < 32:
            raise ValueError(f"Fp8Linear: in_features={in_features} must be a multiple of block_k={bk} and of 32 "
                             f"(the activation group), with block_k >= 32")
        self.in_features, self.out_features = in_features, out_features
        self.block, self.scale_format, self.group = (bn, bk), scale_format, group
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        scale_dtype = torch.float32 if scale_format == "float32" else torch.uint8
        self.scale = nn.Parameter(torch.empty(-(-out_features // bn), in_features // bk, dtype=scale_dtype),
                                  requires_grad=False)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, block: tuple[int, int], scale_format: str) -> Fp8Linear:
        """``linear``'s weight quantised (``models.quant.quant_fp8_block``), on its device."""
        if linear.bias is not None:
            raise NotImplementedError("Fp8Linear: linear layers with a bias are not supported")
        w = linear.weight
        with torch.device(w.device):
            module = cls(linear.in_features, linear.out_features, block, scale_format,
                         getattr(linear, "groups", 1))
        q, s = quant_fp8_block(w.detach(), block, scale_format)
        module.weight.data, module.scale.data = q, s
        return module

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        # x: [..., K] -> [..., N] in x's dtype (grouped: [..., g, K] -> [..., g, N / g]); codes
        # and scales x carries from the kernel that produced it are used (backend.attach_fp8).
        # ``residual`` [..., N]: the product is added to it in place (in the GEMM on CUDA) and
        # it is returned.
        return backend.fp8_linear(x, self.weight, self.scale, self.block, self.group,
                                  self.scale_format == "ue8m0", self.groups, residual)

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 [N, K] (exact)."""
        return dequant_fp8_block(self.weight, self.scale, self.block)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"scale_format={self.scale_format}" + (f", groups={self.groups}" if self.groups > 1 else ""))
