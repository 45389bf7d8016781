"""Weights kept quantised in device memory: which layers, in which format, and the pass that
puts them there (``models.loader.load_model`` runs it after the weights are in place, before
``CausalLM.after_load``).

``quantization`` (``ModelConfig.quantization``, ``LLM(quantization=...)``, ``--quantization``):

- ``"auto"``: the checkpoint's own formats. On CUDA an FP8 checkpoint (``quantization_config``
  with ``quant_method: fp8``) keeps its dense projections in FP8 with its block size and scale
  format, and, with ``expert_dtype: fp4``, its routed experts in packed FP4 with per-32 scales.
  On the CPU everything is dequantised to the compute dtype (the reference path).
- ``"none"``: everything in the compute dtype, on any device.
- ``"fp8"`` / ``"mxfp4-experts"`` / ``"fp8+mxfp4-experts"``: quantise at load, on any device (off
  CUDA the forward dequantises per call: correct and slow, for tests). FP8 takes the checkpoint's
  block size and scale format when it has them, else DeepSeek-V3's 128 x 128 float32 scales;
  MXFP4 experts take UE8M0 scales per 32 inputs.

Which dense layers: the model's ``fp8_linears`` pattern (a regex over module names) when it sets
one (DeepSeek-V4/V4.1: the projections DeepSeek ships in FP8), else every plain ``nn.Linear``
but ``lm_head`` (which stays 16-bit everywhere). Tensor-parallel shards (``parallel/tensor.py``,
tp > 1) stay 16-bit; at tp = 1 those layers are plain linears and are taken. A layer whose input width the FP8 GEMM cannot
take (not a multiple of 32 and of the block) stays 16-bit. Routed experts: every ``FusedMoE``.

The checkpoint's FP8/FP4 tensors reach the model dequantised (``models/loader.py``) and are
quantised again here. With UE8M0 (power-of-two) scales, as DeepSeek-V4 and V4.1 ship, that gives
back the shipped values exactly (a block's scale can only come out smaller, with its codes
scaled up exactly); with float32 scales the 16-bit round trip can move a value by one 16-bit
rounding. The full 16-bit model exists on the device before this pass: loading the shipped
bytes directly is not yet supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepinfer.layers.fused_linear import FusedProjection
from deepinfer.layers.moe import FusedMoE
from deepinfer.layers.quant_linear import Fp8Linear, act_group
from deepinfer.parallel.tensor import ColumnParallelLinear, RowParallelLinear

QUANTIZATIONS = ("auto", "none", "fp8", "mxfp4-experts", "fp8+mxfp4-experts")


@dataclass(frozen=True)
class QuantPlan:
    """What :func:`quantize_model` does: dense FP8 layers (``fp8``) in ``block`` tiles with
    ``scale_format`` scales, and routed experts in FP4 (``fp4_experts``) with ``expert_scale_format``."""

    fp8: bool
    fp4_experts: bool
    block: tuple[int, int] = (128, 128)
    scale_format: str = "float32"
    expert_scale_format: str = "ue8m0"

    def __post_init__(self) -> None:
        if min(self.block) < 1:
            raise ValueError(f"QuantPlan: block={self.block} must be positive")

    @property
    def label(self) -> str:
        return "+".join(["fp8"] * self.fp8 + ["fp4-experts"] * self.fp4_experts) or "none"


def _checkpoint_format(hf_config: dict[str, Any]) -> tuple[tuple[int, int], str, bool]:
    """(FP8 block, scale format, whether experts ship in FP4) from ``quantization_config``."""
    qc = hf_config.get("quantization_config") or {}
    block = qc.get("weight_block_size") or [128, 128]
    if len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size={block} must be [rows, cols]")
    scale_format = "ue8m0" if qc.get("scale_fmt") == "ue8m0" else "float32"
    fp4 = (qc.get("expert_dtype") or hf_config.get("expert_dtype")) == "fp4"
    return (int(block[0]), int(block[1])), scale_format, fp4


def plan_for(hf_config: dict[str, Any], quantization: str, device: torch.device) -> QuantPlan | None:
    """The plan for ``quantization`` (see the module docstring) on ``device``; None: nothing is
    quantised."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported; choose one of {', '.join(QUANTIZATIONS)}")
    block, scale_format, ships_fp4 = _checkpoint_format(hf_config)
    expert_scale_format = scale_format if ships_fp4 else "ue8m0"
    if quantization == "none":
        return None
    if quantization == "auto":
        ships_fp8 = (hf_config.get("quantization_config") or {}).get("quant_method") == "fp8"
        if device.type != "cuda" or not ships_fp8:
            return None
        return QuantPlan(True, ships_fp4, block, scale_format, expert_scale_format)
    return QuantPlan("fp8" in quantization.split("+"), "mxfp4-experts" in quantization.split("+"),
                     block, scale_format, expert_scale_format)


def _plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` with nothing around its GEMM: a tensor-parallel linear only at size 1
    (a shard's collectives have no FP8 counterpart yet, so shards stay 16-bit)."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return module.tp.is_single and not getattr(module, "gather_output", False)
    return type(module) is nn.Linear


def _fp8_candidate(name: str, module: nn.Module, pattern: re.Pattern | None, block: tuple[int, int]) -> bool:
    if not _plain_linear(module) or module.bias is not None or name.split(".")[-1] == "lm_head":
        return False
    if pattern is not None and not pattern.search(name):
        return False
    group = act_group(module.in_features)
    return group is not None and module.in_features % block[1] == 0 and min(group, block[1]) >= 32


@torch.no_grad()
def quantize_model(model: nn.Module, plan: QuantPlan) -> dict[str, int]:
    """Apply ``plan`` to ``model`` in place: swap its FP8 layers for ``Fp8Linear`` (rewiring the
    ``FusedProjection`` objects that hold them) and quantise its routed experts to FP4. Returns
    how many layers of each kind were quantised."""
    counts = {"fp8_linears": 0, "fp4_expert_layers": 0}
    swapped: dict[int, tuple[nn.Module, nn.Module]] = {}
    if plan.fp8:
        raw = getattr(model, "fp8_linears", None)
        pattern = re.compile(raw) if raw else None
        for parent_name, parent in list(model.named_modules()):
            for child_name, child in list(parent.named_children()):
                name = f"{parent_name}.{child_name}" if parent_name else child_name
                if _fp8_candidate(name, child, pattern, plan.block):
                    new = Fp8Linear.from_linear(child, plan.block, plan.scale_format)
                    setattr(parent, child_name, new)
                    swapped[id(child)] = (child, new)
                    counts["fp8_linears"] += 1
        for module in model.modules():
            for value in vars(module).values():
                if isinstance(value, FusedProjection):
                    for old, new in swapped.values():
                        if any(lin is old for lin in value.linears):
                            value.replace(old, new)
    if plan.fp4_experts:
        for module in model.modules():
            if isinstance(module, FusedMoE):
                module.quantize_fp4(plan.expert_scale_format)
                counts["fp4_expert_layers"] += 1
    return counts


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters and persistent buffers in device memory, by kind: ``fp8``
    (FP8 weights and their scales), ``fp4`` (packed experts and their scales), ``other``;
    tied tensors once."""
    fp8_ids = {id(t) for m in model.modules() if isinstance(m, Fp8Linear) for t in (m.weight, m.scale)}
    fp4_ids = {id(t) for m in model.modules() if isinstance(m, FusedMoE) and m.fp4
               for t in (m.gate_up_proj, m.down_proj, m.gate_up_proj_scale, m.down_proj_scale)}
    out = {"fp8": 0, "fp4": 0, "other": 0}
    seen: set[int] = set()
    for tensor in model.state_dict(keep_vars=True).values():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        kind = "fp8" if id(tensor) in fp8_ids else "fp4" if id(tensor) in fp4_ids else "other"
        out[kind] += tensor.numel() * tensor.element_size()
    out["total"] = out["fp8"] + out["fp4"] + out["other"]
    return out
