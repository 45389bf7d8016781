"""Checkpoint loading: safetensors files -> (name, tensor) stream -> model parameters.

What belongs here: finding and reading a checkpoint's files, turning stored
FP8/FP4 tensors into floating point (models/quant.py), or passing them as stored to
the layers that keep the checkpoint's formats (models/quantize.py ``keep_shipped``),
and building a model on its device. Under tensor parallelism tensors are mapped from their files, so
that a rank reads only the shard it copies. What does not: name mapping and shape checks (``CausalLM.load_weights``
and the models' ``remap_weight_name``).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.config import ModelConfig
from deepinfer.host_memory import map_file
from deepinfer.models.base import CausalLM
from deepinfer.models.dummy import init_dummy_weights
from deepinfer.models.quant import pair_scales
from deepinfer.models.quantize import (StoredTensor, deferred_weights, keep_shipped, materialize, plan_for,
                                       quantize_model, weight_bytes)
from deepinfer.models.registry import get_model_class
from deepinfer.parallel.groups import current_groups

logger = logging.getLogger(__name__)


def checkpoint_files(path: str) -> list[Path]:
    """``model.safetensors``, else the shards named in ``model.safetensors.index.json``,
    else every ``*.safetensors`` file in the directory (sorted)."""
    root = Path(path)
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not (root / s).is_file()]
        if absent:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {', '.join(absent)}")
        return [root / s for s in shards]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no checkpoint in {str(root)!r}: expected model.safetensors, "
                                "model.safetensors.index.json or *.safetensors files")
    return files


# safetensors dtype names -> torch dtypes, for tensors mapped straight from a file.
_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def _mapped_tensor(file: Path, header: dict, data_start: int, name: str) -> torch.Tensor:
    """Tensor ``name`` of a safetensors file as a read-only shared map of its bytes."""
    entry = header[name]
    if entry["dtype"] not in _SAFETENSORS_DTYPES:
        raise ValueError(f"checkpoint tensor {name!r} in {file} has dtype {entry['dtype']}, which cannot be "
                         f"mapped; mappable: {', '.join(_SAFETENSORS_DTYPES)}")
    begin, end = entry["data_offsets"]
    return map_file(file, data_start + begin, end - begin, _SAFETENSORS_DTYPES[entry["dtype"]],
                    tuple(entry["shape"]))


def _header(file: Path) -> tuple[dict, int]:
    """(the safetensors header: name -> dtype, shape, data_offsets; where the data starts)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size)), 8 + size


def iter_checkpoint(path: str, mapped: Callable[[str], bool] | None = None,
                    skip: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint at ``path``, on the CPU, one file at a time, except those
    named so that ``skip(name)`` is true, which are never read. Tensors named so that
    ``mapped(name)`` is true come as read-only shared maps of their bytes in the file
    (``host_memory.map_file``: never read until used, never copied, never to be written)."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = list(f.keys())
            header = None
            for name in names:
                if skip is not None and skip(name):
                    continue
                if mapped is not None and mapped(name):
                    if header is None:
                        header = _header(file)
                    yield name, _mapped_tensor(file, *header, name)
                else:
                    yield name, f.get_tensor(name)


def fp8_block_size(hf_config: dict, default: int = 128) -> int:
    """FP8 block size from ``quantization_config.weight_block_size`` (square blocks; ``default``
    when the config names none)."""
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size") or [default, default]
    if len(set(block)) != 1:
        raise NotImplementedError(f"quantization_config.weight_block_size={block}: only square "
                                  "blocks are supported")
    return int(block[0])


def iter_weights(path: str, hf_config: dict,
                 keep_quantized: Callable[[str], bool] | None = None,
                 skip: Callable[[str], bool] | None = None,
                 map_all: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model takes them: FP8/FP4 weights dequantised
    with their scale tensors (which are consumed), everything else unchanged. Tensors named
    so that ``keep_quantized(name)`` is true (``CausalLM.keeps_quantized``) pass as stored,
    mapped from the file; those named so that ``skip(name)`` is true (``CausalLM.skips_tensor``:
    other expert-parallel ranks' experts) are left out unread (:func:`iter_checkpoint`). With
    ``map_all`` every tensor comes mapped from its file (read-only) instead of read whole."""
    mapped = (lambda _: True) if map_all else keep_quantized
    return pair_scales(iter_checkpoint(path, mapped, skip), fp8_block=fp8_block_size(hf_config),
                       keep=keep_quantized)


# safetensors dtypes of quantised weights (FP8, packed FP4) and their scales.
_QUANTISED_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "I8")


def stored_tensors(path: str) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint at ``path`` as its header describes it (nothing else read)."""
    out = {}
    for file in checkpoint_files(path):
        header, _ = _header(file)
        out.update({k: StoredTensor(e["dtype"], tuple(e["shape"])) for k, e in header.items() if k != "__metadata__"})
    return out


def quantised_checkpoint_bytes(path: str) -> int:
    """Bytes of the checkpoint's FP8 / packed FP4 tensors and scale tensors (from the headers),
    what its weights take as shipped, to compare with what the model keeps quantised."""
    total = 0
    for file in checkpoint_files(path):
        header, _ = _header(file)
        total += sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items()
                     if k != "__metadata__" and e["dtype"] in _QUANTISED_DTYPES)
    return total


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_config: ModelConfig, device: torch.device, seed: int = 0) -> CausalLM:
    """Build the registered model for the checkpoint's architecture directly on
    ``device`` in ``model_config.dtype``, load its weights (or, with ``load_format="dummy"``,
    fill them with random values from ``seed``), keep the weights ``model_config.quantization``
    asks for quantised (models/quantize.py: the layers that keep a checkpoint's own formats are
    made quantised before loading and take its bytes as stored, without a 16-bit copy; the
    others are quantised after loading), run its ``after_load`` hook (weight re-layout such
    as fused projections), log the weights' bytes in device memory by kind
    (``model.weight_bytes``), and put it in eval mode. Built under an expert-parallel group
    (``parallel.groups.use_groups``), the model holds and reads only this rank's routed experts."""
    model_cls = get_model_class(model_config.architecture)
    kv_dtype = model_config.kv_cache_dtype
    if kv_dtype != "auto" and kv_dtype not in model_cls.kv_cache_dtypes:
        supported = ", ".join(model_cls.kv_cache_dtypes or ("auto",))
        raise ValueError(f"kv_cache_dtype={kv_dtype!r} is not supported for {model_config.architecture}; "
                         f"supported: {supported}")
    options = {"kv_cache_dtype": kv_dtype} if model_cls.kv_cache_dtypes else {}
    plan = plan_for(model_config.hf_config, model_config.quantization, device)
    # With a plan, the layers that keep the checkpoint's formats must never hold 16-bit weights:
    # linear and expert weights are built without memory until keep_shipped has chosen them.
    shipped = plan is not None and model_config.load_format != "dummy"
    with torch.device(device), _default_dtype(model_config.dtype), deferred_weights() if shipped else nullcontext():
        model = model_cls(model_config.hf_config, model_config.dtype, **options)
    if shipped:
        kept = keep_shipped(model, plan, stored_tensors(model_config.path), device)
        materialize(model, device)
        logger.info("loading as shipped: %d FP8 linear layers, %d FP4 expert layers (%d checkpoint tensors)",
                    kept["fp8_linears"], kept["fp4_expert_layers"], len(model.shipped_tensors))
    model.load_assets(model_config.path)
    if model_config.load_format == "dummy":
        init_dummy_weights(model, seed)
        model.dummy_seed = seed
    else:
        # A tensor-parallel rank copies only its shard of each tensor (CausalLM.load_weights):
        # mapped from the file, the rest of the tensor is never read into this process.
        sharded = not current_groups().tp.is_single
        model.load_weights(iter_weights(model_config.path, model_config.hf_config, model.keeps_quantized,
                                        model.skips_tensor, map_all=sharded))
    if plan is not None:
        counts = quantize_model(model, plan)
        logger.info("weights kept as %s: %d FP8 linear layers (%dx%d blocks, %s scales), %d FP4 expert layers "
                    "(%s scales) quantised after loading", plan.label, counts["fp8_linears"], *plan.block,
                    plan.scale_format, counts["fp4_expert_layers"], plan.expert_scale_format)
    model.after_load()
    model.weight_bytes = weight_bytes(model)
    logger.info("weights in %s memory: %.3f GiB (FP8 %.3f, FP4 %.3f, other %.3f)", device.type,
                *(model.weight_bytes[k] / 2**30 for k in ("total", "fp8", "fp4", "other")))
    if plan is not None and model_config.load_format != "dummy":
        # Shipped FP8 tensors the model keeps 16-bit (grouped o_a, host-memory engram tables,
        # MTP drafter tensors) make the first figure the larger.
        logger.info("the checkpoint ships %.3f GiB of FP8/FP4 tensors and scales; the model keeps %.3f GiB "
                    "quantised", quantised_checkpoint_bytes(model_config.path) / 2**30,
                    (model.weight_bytes["fp8"] + model.weight_bytes["fp4"]) / 2**30)
    model.requires_grad_(False)
    return model.eval()
