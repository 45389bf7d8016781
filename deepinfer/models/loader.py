"""Checkpoint loading: safetensors files -> (name, tensor) stream -> model parameters.

What belongs here: finding and reading a checkpoint's files, turning stored
tensors into the compute dtype (the dequantisation hook), and building a model
on its device. What does not: name mapping and shape checks (``CausalLM.load_weights``
and the models' ``remap_weight_name``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from deepinfer.config import ModelConfig
from deepinfer.models.base import CausalLM
from deepinfer.models.registry import get_model_class

# Names of the per-block scale tensors that accompany quantised weights
# (DeepSeek-V3 FP8: ``...weight_scale_inv``; DeepSeek's own format: ``...scale``).
_SCALE_SUFFIXES = ("_scale_inv", ".scale")
_QUANTIZED_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2",
                                                      "float8_e8m0fnu", "float4_e2m1fn_x2")
                          if hasattr(torch, n))


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


def iter_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint at ``path``, on the CPU, one file at a time."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def is_scale_tensor(name: str) -> bool:
    return name.endswith(_SCALE_SUFFIXES)


def read_scale_tensors(path: str) -> dict[str, torch.Tensor]:
    """All quantisation scale tensors of the checkpoint (small; read before the weights)."""
    scales: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if is_scale_tensor(name):
                    scales[name] = f.get_tensor(name)
    return scales


def dequantize(name: str, tensor: torch.Tensor, scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """Checkpoint tensor ``name`` as a plain floating-point tensor, given every scale
    tensor of the checkpoint. This is where FP8/FP4 dequantisation plugs in;
    unquantised tensors pass through unchanged."""
    if tensor.dtype in _QUANTIZED_DTYPES:
        raise NotImplementedError(f"checkpoint tensor {name!r} is stored as {tensor.dtype}: "
                                  "loading FP8/FP4 checkpoints is not implemented yet")
    return tensor


def iter_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the model takes them: scale tensors consumed,
    quantised weights dequantised."""
    scales = read_scale_tensors(path)
    for name, tensor in iter_checkpoint(path):
        if name not in scales:
            yield name, dequantize(name, tensor, scales)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(model_config: ModelConfig, device: torch.device) -> CausalLM:
    """Build the registered model for the checkpoint's architecture directly on
    ``device`` in ``model_config.dtype``, load its weights, and put it in eval mode."""
    model_cls = get_model_class(model_config.architecture)
    with torch.device(device), _default_dtype(model_config.dtype):
        model = model_cls(model_config.hf_config, model_config.dtype)
    model.load_weights(iter_weights(model_config.path))
    model.requires_grad_(False)
    return model.eval()
