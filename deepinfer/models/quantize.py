"""Weights kept quantised in device memory: which layers, in which format, and how they get
there (``models.loader.load_model``): layers kept in the format the checkpoint ships them in are
made quantised before loading and take its bytes as stored (:func:`keep_shipped`); the others
are quantised after the weights are in place, before ``CausalLM.after_load`` (:func:`quantize_model`).

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

Loading the shipped bytes (``models/loader.py``, a checkpoint rather than dummy weights, with a
plan). The model is built under :func:`deferred_weights`: the weights of linear layers and routed
experts start on the meta device (no memory). :func:`keep_shipped` then reads the checkpoint's
headers (names, dtypes, shapes; no data) and makes quantised, before any weight loads, each layer
the plan keeps in the checkpoint's own format:

- an FP8 layer whose one checkpoint weight is e4m3 with a scale of the plan's block grid and
  format (UE8M0 stored as ``F8_E8M0`` or ``U8``; float32 as ``F32``) becomes an empty
  ``Fp8Linear``;
- an expert layer all of whose local experts (expert parallelism: this rank's only) ship packed
  FP4 (``I8``/``U8``) with per-32 scales of the plan's expert format becomes empty FP4
  (``FusedMoE.make_fp4``).

Their codes and scales (``CausalLM.shipped_tensors``) then pass the loader undequantised and are
copied bit for bit into the layers' buffers (``models.base.load_module_weights``); the other
deferred weights get memory (:func:`materialize`) and load as before. So the 16-bit copy of a
layer that keeps its shipped format never exists (but for an instant, one ``nn.Linear`` weight
at a time: see :func:`deferred_weights`), and the load peak is the model's size as kept, not its
16-bit size. Fused projections (``FusedProjection``) stack their FP8 pieces'
codes and scales at ``after_load`` when each piece's output width is a multiple of the block's
rows, else run them one by one; a layer whose weight a checkpoint splits into parts (a
``ParamSlice``) is not among those loaded directly.

Everything else the plan names goes the way it went before: its FP8/FP4 tensors reach the model
dequantised (``models/quant.py``) and :func:`quantize_model` quantises them again after loading.
With UE8M0 (power-of-two) scales, as DeepSeek-V4 and V4.1 ship, that gives back the shipped
values exactly (a block's scale can only come out smaller, with its codes scaled up exactly);
with float32 scales the 16-bit round trip can move a value by one 16-bit rounding. That is the
path of a 16-bit checkpoint quantised at load, of a layer quantised in another format than it
ships in, and of tensor-parallel shards (16-bit), whose 16-bit weights exist until the pass.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from deepinfer.layers.deepseek_v4_attention import GroupedLinear
from deepinfer.layers.fused_linear import FusedProjection
from deepinfer.layers.moe import EXPERTS_ON_META, FusedMoE
from deepinfer.layers.quant_linear import Fp8Linear, act_group
from deepinfer.models.base import OTHER_RANK, CausalLM, ParamSlice
from deepinfer.models.quant import scale_name_for
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
    (a shard's collectives have no FP8 counterpart yet, so shards stay 16-bit); a
    ``GroupedLinear`` (block-diagonal, ``Fp8Linear(groups=...)``) unless it is a shard."""
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return module.tp.is_single and not getattr(module, "gather_output", False)
    if isinstance(module, GroupedLinear):
        return getattr(module.weight, "tp_shard", None) is None and (module.out_features // module.groups) % 16 == 0
    return type(module) is nn.Linear


def _fp8_candidate(name: str, module: nn.Module, pattern: re.Pattern | None, block: tuple[int, int]) -> bool:
    if not _plain_linear(module) or module.bias is not None or name.split(".")[-1] == "lm_head":
        return False
    if pattern is not None and not pattern.search(name):
        return False
    group = act_group(module.in_features)
    return group is not None and module.in_features % block[1] == 0 and min(group, block[1]) >= 32


def _fp8_layers(model: nn.Module, plan: QuantPlan) -> dict[str, nn.Module]:
    """The layers ``plan`` keeps in FP8, by module name (none if it keeps none)."""
    if not plan.fp8:
        return {}
    raw = getattr(model, "fp8_linears", None)
    pattern = re.compile(raw) if raw else None
    return {name: m for name, m in model.named_modules() if _fp8_candidate(name, m, pattern, plan.block)}


def _swap(model: nn.Module, new: Mapping[str, nn.Module]) -> None:
    """Put each module of ``new`` in the place its name gives, rewiring the ``FusedProjection``
    objects that held the old one."""
    swapped = []
    for name, module in new.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        swapped.append((getattr(parent, child), module))
        setattr(parent, child, module)
    for holder in model.modules():
        for value in vars(holder).values():
            if isinstance(value, FusedProjection):
                for old, module in swapped:
                    if any(lin is old for lin in value.linears):
                        value.replace(old, module)


@torch.no_grad()
def quantize_model(model: nn.Module, plan: QuantPlan) -> dict[str, int]:
    """Apply ``plan`` to ``model`` in place: swap its FP8 layers for ``Fp8Linear`` (rewiring the
    ``FusedProjection`` objects that hold them) and quantise its routed experts to FP4; layers
    already quantised (:func:`keep_shipped`) are left as they are. Returns how many layers of
    each kind were quantised."""
    layers = _fp8_layers(model, plan)
    _swap(model, {name: Fp8Linear.from_linear(m, plan.block, plan.scale_format) for name, m in layers.items()})
    counts = {"fp8_linears": len(layers), "fp4_expert_layers": 0}
    if plan.fp4_experts:
        for module in model.modules():
            if isinstance(module, FusedMoE) and not module.fp4:
                module.quantize_fp4(plan.expert_scale_format)
                counts["fp4_expert_layers"] += 1
    return counts


class StoredTensor(NamedTuple):
    """A checkpoint tensor as its file's header describes it."""

    dtype: str                   # the safetensors dtype name: "F8_E4M3", "F8_E8M0", "I8", ...
    shape: tuple[int, ...]


# Safetensors dtypes of scales stored as each scale format.
_SCALE_DTYPES = {"ue8m0": ("F8_E8M0", "U8"), "float32": ("F32",)}
# Safetensors dtypes of packed FP4 codes that the loader can map (two e2m1 codes a byte).
_FP4_CODE_DTYPES = ("I8", "U8")


def _shipped_fp8(layer: nn.Module, weight: StoredTensor, scale: StoredTensor, plan: QuantPlan) -> bool:
    bn, bk = plan.block
    grid = (-(-layer.out_features // bn), layer.in_features // bk)
    return (weight.dtype == "F8_E4M3" and weight.shape == (layer.out_features, layer.in_features)
            and scale.dtype in _SCALE_DTYPES[plan.scale_format] and scale.shape == grid)


def _shipped_fp4(layer: FusedMoE, dest: ParamSlice, weight: StoredTensor, scale: StoredTensor,
                 plan: QuantPlan) -> bool:
    param = dest.name.rpartition(".")[2]
    if param not in ("gate_up_proj", "down_proj"):
        return False
    rows, cols = getattr(layer, param)[dest.index].shape
    return (weight.dtype in _FP4_CODE_DTYPES and weight.shape == (rows, cols // 2)
            and scale.dtype in _SCALE_DTYPES[plan.expert_scale_format] and scale.shape == (rows, cols // 32))


def shipped_layers(model: CausalLM, plan: QuantPlan, checkpoint: Mapping[str, StoredTensor]
                   ) -> dict[str, tuple[str, ...]]:
    """The layers of ``model`` (FP8 linears, FP4 expert stacks) that ``plan`` keeps in the format
    ``checkpoint`` ships them in (see the module docstring), by module name, each with the
    checkpoint tensors (weights and scales) that fill it. A layer with a part shipped in another
    format, shape or split is left out, and loads the dequantise-then-quantise way."""
    block, _, _ = _checkpoint_format(model.hf_config)
    fp8 = _fp8_layers(model, plan) if block == plan.block else {}
    experts = {name: m for name, m in model.named_modules()
               if plan.fp4_experts and isinstance(m, FusedMoE) and not m.packed and not m.fp4
               and m.hidden_size % 32 == 0 and m.intermediate_size % 32 == 0}
    takes: dict[str, list[str]] = {}
    refused: set[str] = set()
    for name, weight in checkpoint.items():
        scale_name = scale_name_for(name, checkpoint)
        if scale_name is None:
            continue
        try:
            dest = model.remap_weight_name(name)
        except (ValueError, NotImplementedError):
            continue          # the load reports it
        if dest is None or dest is OTHER_RANK:
            continue
        pname = dest if isinstance(dest, str) else dest.name
        module_name = pname.rpartition(".")[0]
        scale = checkpoint[scale_name]
        if module_name in fp8:
            ok = pname.endswith(".weight") and isinstance(dest, str) and _shipped_fp8(fp8[module_name], weight, scale,
                                                                                      plan)
        elif module_name in experts:
            ok = isinstance(dest, ParamSlice) and _shipped_fp4(experts[module_name], dest, weight, scale, plan)
        else:
            continue
        if not ok:
            refused.add(module_name)
        takes.setdefault(module_name, []).extend((name, scale_name))
    # Whole layers only: an FP8 layer from one weight, an expert stack from each local expert's
    # gate, up and down projections.
    whole = {name: 2 for name in fp8} | {name: 6 * m.gate_up_proj.shape[0] for name, m in experts.items()}
    return {name: tuple(names) for name, names in takes.items()
            if name not in refused and len(set(names)) == len(names) == whole[name]}


@torch.no_grad()
def keep_shipped(model: CausalLM, plan: QuantPlan, checkpoint: Mapping[str, StoredTensor],
                 device: torch.device) -> dict[str, int]:
    """Make the :func:`shipped_layers` of ``model`` quantised and empty on ``device`` (FP8 layers
    swapped for ``Fp8Linear``, expert stacks ``FusedMoE.make_fp4``) and record their checkpoint
    tensors in ``model.shipped_tensors``, which then load as stored. Returns how many layers of
    each kind."""
    layers = shipped_layers(model, plan, checkpoint)
    fp8: dict[str, nn.Module] = {}
    experts = 0
    for name in layers:
        module = model.get_submodule(name)
        if isinstance(module, FusedMoE):
            module.make_fp4(plan.expert_scale_format, device)
            experts += 1
        else:
            with torch.device(device):
                fp8[name] = Fp8Linear(module.in_features, module.out_features, plan.block, plan.scale_format,
                                      getattr(module, "groups", 1))
    _swap(model, fp8)
    model.shipped_tensors = frozenset(n for names in layers.values() for n in names)
    return {"fp8_linears": len(fp8), "fp4_expert_layers": experts}


@contextmanager
def deferred_weights() -> Iterator[None]:
    """While a model is built inside it, the weights of linear layers and routed experts are
    created on the meta device (no memory): :func:`keep_shipped` may replace their layers by
    quantised ones, and :func:`materialize` gives the others memory. Expert stacks are made on
    the meta device (``layers.moe.EXPERTS_ON_META``); a linear layer's weight, which
    ``nn.Linear`` allocates itself, is swapped for a meta one as it is registered, so it exists
    for that instant only (one layer's weight; freed memory is reused for the next). A parameter
    already registered elsewhere (an ``lm_head`` tied to the embedding) is left as it is."""
    seen: dict[int, weakref.ref] = {}

    def defer(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None:
            return None
        known = seen.get(id(param))
        if known is not None and known() is param:
            return None
        deferred = ((isinstance(module, nn.Linear) and name == "weight")
                    or (isinstance(module, FusedMoE) and name in ("gate_up_proj", "down_proj")))
        if not deferred or param.is_meta:
            seen[id(param)] = weakref.ref(param)
            return None
        meta = _like(param, "meta")
        seen[id(meta)] = weakref.ref(meta)
        return meta

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(defer)
    token = EXPERTS_ON_META.set(True)
    try:
        yield
    finally:
        EXPERTS_ON_META.reset(token)
        handle.remove()


def materialize(model: nn.Module, device: torch.device) -> int:
    """Give every parameter of ``model`` still on the meta device (:func:`deferred_weights`)
    uninitialised memory on ``device``, in place (a parameter registered twice stays one).
    Returns how many were given memory."""
    made: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}    # id(meta) -> (meta, on device)
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and param.is_meta:
                if id(param) not in made:
                    made[id(param)] = (param, _like(param, device))
                module._parameters[key] = made[id(param)][1]
    return len(made)


def _like(param: nn.Parameter, device: torch.device | str) -> nn.Parameter:
    """An uninitialised parameter of ``param``'s shape and dtype on ``device``, with its attributes
    (a tensor-parallel shard's ``tp_shard``, set after registration)."""
    new = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    return new


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
