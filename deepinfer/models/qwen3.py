"""Qwen3 (dense): Llama with per-head q/k RMSNorm and optional sliding-window layers.

Shape legend: as in models/llama.py (T tokens, H hidden, Hq/Hkv heads, D head dim, V vocab).

Which layers slide follows HF: ``layer_types`` from config.json when present,
otherwise layer i slides when ``use_sliding_window`` and ``i >= max_window_layers``.
The window is ``sliding_window``, and only when ``use_sliding_window`` is true.
"""

from __future__ import annotations

from deepinfer.models.base import config_value
from deepinfer.models.llama import LlamaAttention, LlamaForCausalLM

_LAYER_TYPES = ("full_attention", "sliding_attention")


def sliding_window(hf_config: dict) -> int | None:
    """The window of sliding layers; HF drops ``sliding_window`` unless ``use_sliding_window``."""
    window = hf_config.get("sliding_window")
    return int(window) if window and hf_config.get("use_sliding_window") else None


def qwen3_layer_types(hf_config: dict) -> list[str]:
    """Per-layer attention type, as HF's Qwen3Config derives it."""
    n = int(config_value(hf_config, "num_hidden_layers"))
    window = sliding_window(hf_config)
    types = hf_config.get("layer_types")
    if types is None:
        first_sliding = int(hf_config.get("max_window_layers", 28))
        return ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                for i in range(n)]
    if len(types) != n or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"config.json layer_types={types} must list {n} entries, each one of "
                         f"{', '.join(_LAYER_TYPES)}")
    return list(types)


class Qwen3ForCausalLM(LlamaForCausalLM):
    def sliding_window_for(self, layer_idx: int) -> int | None:
        window = sliding_window(self.hf_config)
        if window and qwen3_layer_types(self.hf_config)[layer_idx] == "sliding_attention":
            return window
        return None

    def make_attention(self, layer_idx: int) -> LlamaAttention:
        return LlamaAttention(self.args, self.dtype, self.sliding_window_for(layer_idx), qk_norm=True)
