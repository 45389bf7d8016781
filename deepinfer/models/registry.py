"""HF ``architectures`` name -> model class, imported only when asked for."""

from __future__ import annotations

import importlib

from deepinfer.models.base import CausalLM

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "deepinfer.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "deepinfer.models.mistral:MistralForCausalLM",
    "Qwen3ForCausalLM": "deepinfer.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "deepinfer.models.qwen3_moe:Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM": "deepinfer.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM": "deepinfer.models.deepseek_v4:DeepseekV4ForCausalLM",
    "DeepseekV41ForCausalLM": "deepinfer.models.deepseek_v41:DeepseekV41ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(arch: str) -> type[CausalLM]:
    """The class for config.json's ``architectures[0]``; ValueError listing the supported names if unknown."""
    if arch not in _MODELS:
        raise ValueError(f"architecture {arch!r} is not supported; supported architectures: "
                         f"{', '.join(supported_architectures())}")
    module_name, class_name = _MODELS[arch].split(":")
    return getattr(importlib.import_module(module_name), class_name)
