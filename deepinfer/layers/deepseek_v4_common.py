"""Small DeepSeek-V4 building blocks: float32-weight RMSNorm, interleaved partial
RoPE (default and YaRN inverse frequencies), and the paged-cache slot modules.

V4 keeps norm weights in float32 and multiplies before casting back (unlike the
Llama-style norm in layers/norm.py), and rotates *adjacent* channel pairs of
the trailing ``R`` channels of a head (unlike the rotate-half RoPE in
layers/rotary.py). The numerics follow HF transformers' ``deepseek_v4``. The rotation
itself (fused with the q / kv norms) is a kernel: ``kernels/backend.py``
``q_norm_rope`` / ``kv_norm_rope`` / ``interleaved_rope``.

Shapes: T tokens, H heads, D head dim, R rotary dims (R/2 frequencies).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.kernels import backend
from deepinfer.kv_spec import KVCacheSpec


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` in float32, cast back to x's dtype at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps
        # (group, pow2_scale) of the FP8 linears that read the output, set after load
        # (``note_fp8_inputs``): the kernel then quantises the output for them in the same launch.
        self.fp8_out: tuple[int, bool] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backend.rms_norm(x, self.weight, self.eps, round_first=False, fp8=self.fp8_out)

    def params(self) -> tuple[torch.Tensor, float]:
        """(weight, eps), for a kernel that applies this norm to the input it produces
        (``HyperConnection``'s ``norm``)."""
        return self.weight, self.eps


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    """[dim/2] float32: ``base ** (-2i/dim)``."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def yarn_inv_freq(dim: int, base: float, factor: float, original_max_position: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """YaRN inverse frequencies [dim/2]: interpolated by ``factor`` below the
    ``beta_slow`` rotation count, kept above ``beta_fast``, blended linearly in between."""
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max_position / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class InterleavedRope(nn.Module):
    """One rope type (``rope_type`` "default" or "yarn"): ``inv_freq`` [R/2] float32 and the
    attention ``scaling`` that the rope kernels (kernels/backend.py) take."""

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int) -> None:
        super().__init__()
        self.rot_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        base = float(params["rope_theta"])
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            inv_freq, self.scaling = default_inv_freq(self.rot_dim, base), 1.0
        elif rope_type == "yarn":
            factor = params["factor"]
            inv_freq = yarn_inv_freq(
                self.rot_dim, base, factor,
                params.get("original_max_position_embeddings", max_position_embeddings),
                params.get("beta_fast") or 32, params.get("beta_slow") or 1)
            self.scaling = params.get("attention_factor")
            if self.scaling is None:
                mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
                self.scaling = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                                if mscale and mscale_all else _yarn_mscale(factor))
        else:
            raise NotImplementedError(f"rope_type={rope_type!r} is not supported for DeepSeek-V4; "
                                      "supported: default, yarn")
        # Derived from the config, so not part of the checkpoint.
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class CacheSlot(nn.Module):
    """One paged KV cache of a layer: declares ``kv_spec``; the runner binds
    ``kv_cache`` ([num_blocks, block_size, num_tensors, 1, head_size]) and ``group_id``."""

    def __init__(self, spec: KVCacheSpec) -> None:
        super().__init__()
        self.kv_spec = spec
        self.kv_cache: torch.Tensor | None = None
        self.group_id: int | None = None

    def meta(self, ctx: ForwardContext) -> GroupMetadata:
        return ctx.groups[self.group_id]

    def extra_repr(self) -> str:
        s = self.kv_spec
        return (f"{s.kind}, tensors={s.num_tensors}, size={s.head_size}, window={s.sliding_window}, "
                f"ratio={s.compress_ratio}")
