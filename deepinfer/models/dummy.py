"""Random ("dummy") weights: a model without a checkpoint, for benchmarks at real widths.

Each parameter and persistent buffer is filled from its own generator, seeded by
(seed, tensor name), on the tensor's device. The same name therefore gets the same
values in any model that has it: ours, and HF transformers' (whose state-dict names
ours follow), get identical weights without a copy of either. Values are never zeros
and are scaled so activations stay O(1) through the layers:

- matrices, stacked expert matrices, embeddings: ``N(0, 1/fan_in)``, fan_in = last dim (of the
  whole matrix, for a tensor-parallel shard; each shard draws its own values, so a model at
  tp > 1 does not get the tp=1 weights);
- norm weights (1-D, "norm" in the name): ``1 + N(0, 0.1^2)``;
- the router's score-correction bias: ``N(0, 0.01^2)``, so routing stays close to
  balanced, as a trained bias keeps it;
- other vectors (attention sinks, hyper-connection bases and scales): ``N(0, 0.5^2)``;
- token -> expert tables (``tid2eid``, hash routing): K distinct uniform expert ids per row.

Weights a module keeps outside its state dict (DeepSeek-V4.1's host-memory engram tables) are
filled by the module's own ``fill_dummy_(generator, device)``, with a CPU generator seeded by
its module name.

Draws are float32, in chunks of ``_CHUNK`` elements (bounded temporary memory on the
device), cast to the tensor's dtype.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

_CHUNK = 1 << 26
_NORM_STD, _BIAS_STD, _VECTOR_STD = 0.1, 0.01, 0.5


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63))
    return g


@torch.no_grad()
def fill_dummy_(tensor: torch.Tensor, name: str, seed: int, num_experts: int | None = None,
                fan_in: int | None = None) -> None:
    """Fill ``tensor`` (named ``name`` in its model's state dict) in place; see the module docstring.
    ``num_experts`` bounds the ids of an integer ``tid2eid`` table; ``fan_in`` (default: the last
    dim) is the full input width of a tensor-parallel shard of it."""
    if not tensor.is_contiguous():
        raise ValueError(f"dummy weights: tensor {name!r} is not contiguous")
    g = _generator(name, seed, tensor.device)
    flat = tensor.view(-1)
    if not tensor.is_floating_point():
        if not name.endswith("tid2eid") or tensor.dim() != 2:
            raise NotImplementedError(f"dummy weights: integer tensor {name!r} of shape "
                                      f"{tuple(tensor.shape)} has no known random fill")
        if num_experts is None or num_experts < tensor.shape[1]:
            raise ValueError(f"dummy weights: {name!r} needs num_experts >= {tensor.shape[1]} "
                             f"distinct ids per row, got {num_experts}")
        rows_per_chunk = max(1, _CHUNK // num_experts)
        for r0 in range(0, tensor.shape[0], rows_per_chunk):
            rows = min(rows_per_chunk, tensor.shape[0] - r0)
            keys = torch.rand(rows, num_experts, generator=g, device=tensor.device)
            tensor[r0:r0 + rows].copy_(keys.argsort(dim=-1)[:, :tensor.shape[1]])
        return
    if tensor.dim() >= 2:
        mean, std = 0.0, (fan_in or tensor.shape[-1]) ** -0.5
    elif "norm" in name:
        mean, std = 1.0, _NORM_STD
    elif name.endswith("e_score_correction_bias"):
        mean, std = 0.0, _BIAS_STD
    else:
        mean, std = 0.0, _VECTOR_STD
    for i in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - i)
        draw = torch.randn(n, generator=g, device=tensor.device, dtype=torch.float32)
        flat[i:i + n].copy_(draw.mul_(std).add_(mean))


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter and persistent buffer of ``model`` (tied tensors once, under their
    first name). The expert count for ``tid2eid`` tables comes from ``model.hf_config``."""
    cfg = getattr(model, "hf_config", {}) or {}
    num_experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts")
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        # A row-parallel shard holds 1/size of its inputs: scale as the whole matrix would.
        shard = getattr(tensor, "tp_shard", None)
        fan_in = tensor.shape[-1] * shard[2] if shard is not None and shard[0] == tensor.dim() - 1 else None
        fill_dummy_(tensor.data, name, seed, num_experts, fan_in)
    device = next(model.parameters()).device
    for name, module in model.named_modules():
        fill = getattr(module, "fill_dummy_", None)
        if fill is not None:
            fill(_generator(name, seed, torch.device("cpu")), device)
