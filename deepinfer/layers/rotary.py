"""Rotary position embedding (rotate-half layout) and HF rope-parameter parsing.

Supported ``rope_type``: "default", "linear", "llama3". Both config layouts are
read: transformers 5's ``rope_parameters`` dict and the older ``rope_theta`` +
``rope_scaling`` fields.

Shapes: T tokens, H heads, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer.kernels import backend

_DEFAULT_THETA = 10000.0
_SUPPORTED = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict) -> dict:
    """The model's rope parameters in transformers 5's standard form
    (``rope_type``, ``rope_theta`` and the type's own fields)."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise NotImplementedError("per-layer-type rope_parameters are not supported; "
                                  f"got keys {sorted(params)}")
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", hf_config.get("rope_theta", _DEFAULT_THETA))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", hf_config["max_position_embeddings"])
    return params


def inv_frequencies(params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2] float32, attention scaling of cos/sin), as HF computes them."""
    rope_type = params["rope_type"]
    if rope_type not in _SUPPORTED:
        raise NotImplementedError(f"rope_type={rope_type!r} is not supported; supported: "
                                  f"{', '.join(_SUPPORTED)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError(f"partial_rotary_factor={params['partial_rotary_factor']} is not "
                                  "supported; only 1.0 is")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)                          # [D/2]
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scaling(inv_freq, params)
    return inv_freq, 1.0


def _llama3_scaling(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by ``factor``, blend in between."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the batch's positions, and their application to q and k."""

    def __init__(self, head_dim: int, params: dict) -> None:
        super().__init__()
        inv_freq, self.attention_scaling = inv_frequencies(params, head_dim)
        # Derived from the config, so not part of the checkpoint.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, D/2] float32
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, H, D] -> [T, H, D]
        return backend.apply_rope(x, cos, sin)

    @staticmethod
    def apply_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, Hq, D], k: [T, Hk, D] -> rotated (q, k); may rotate in place, so the
        # caller must not read its q and k afterwards.
        return backend.apply_rope_qk(q, k, cos, sin)
