"""Mistral: Llama with sliding-window attention in every layer (when ``sliding_window`` is set).

Shape legend: as in models/llama.py (T tokens, H hidden, Hq/Hkv heads, D head dim, V vocab).
"""

from __future__ import annotations

from deepinfer.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    def sliding_window_for(self, layer_idx: int) -> int | None:
        window = self.hf_config.get("sliding_window")
        return int(window) if window else None
