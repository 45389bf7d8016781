"""Model shapes for ``deepinfer bench prefill | decode | curve --config``.

``--config`` is a preset name or a path to a config.json (or a directory holding
one); ``--num-layers N`` keeps the widths and changes the depth, so one GPU can
measure the real model's per-layer cost. Weights are random (``load_format="dummy"``),
so the config is all a benchmark needs. MTP layers are dropped
(``num_nextn_predict_layers=0``): the engine does not run them yet.

Depth changes: explicit ``layer_types`` / ``compress_ratios`` repeat their main-layer
pattern; ``mlp_layer_types`` keep their first entries and continue with ``"moe"``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from deepinfer.layers.deepseek_v4_attention import CSA, HCA, SLIDING

V4_ARCH = "DeepseekV4ForCausalLM"

# DeepSeek-V4-Flash widths with a [SWA, CSA, HCA, CSA] layer pattern, the first layer
# hash-routed; 4 layers are about 27.4B parameters (54.8 GB in bf16).
_V4_FLASH: dict[str, Any] = {
    "architectures": [V4_ARCH], "model_type": "deepseek_v4",
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "sliding_window": 128, "compress_rates": {CSA: 4, HCA: 128},
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "partial_rotary_factor": 64 / 512, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536},
    "max_position_embeddings": 1048576, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "num_nextn_predict_layers": 0,
}
_V4_PATTERN = (SLIDING, CSA, HCA, CSA)
_V4_HASH_LAYERS = 1

PRESETS = ("deepseek-v4-flash",)
DEFAULT_LAYERS = {"deepseek-v4-flash": 4}


def _v4_flash(num_layers: int) -> dict[str, Any]:
    cfg = copy.deepcopy(_V4_FLASH)
    cfg["num_hidden_layers"] = num_layers
    cfg["layer_types"] = [_V4_PATTERN[i % len(_V4_PATTERN)] for i in range(num_layers)]
    cfg["mlp_layer_types"] = ["hash_moe" if i < _V4_HASH_LAYERS else "moe" for i in range(num_layers)]
    return cfg


def with_num_layers(hf_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``hf_config`` at depth ``num_layers`` (see the module docstring), without MTP layers."""
    if num_layers < 1:
        raise ValueError(f"--num-layers={num_layers} must be >= 1")
    cfg = copy.deepcopy(hf_config)
    old = int(cfg.get("num_hidden_layers", num_layers))
    for key in ("layer_types", "compress_ratios"):
        if cfg.get(key) is not None:
            main = list(cfg[key][:old])
            if not main:
                raise ValueError(f"config {key} is empty; it must list one entry per layer")
            cfg[key] = [main[i % len(main)] for i in range(num_layers)]
    if cfg.get("mlp_layer_types") is not None:
        main = list(cfg["mlp_layer_types"][:old])
        cfg["mlp_layer_types"] = [main[i] if i < len(main) else "moe" for i in range(num_layers)]
    cfg["num_hidden_layers"] = num_layers
    cfg["num_nextn_predict_layers"] = 0
    return cfg


def resolve_config(config: str, num_layers: int | None = None) -> tuple[str, dict[str, Any]]:
    """(label, HF config dict) for a preset name or a config.json path / model directory."""
    if config in PRESETS:
        n = num_layers if num_layers is not None else DEFAULT_LAYERS[config]
        if n < 1:
            raise ValueError(f"--num-layers={n} must be >= 1")
        return f"{config} ({n} layers)", _v4_flash(n)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--config={config!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                                "config.json file or a directory holding one")
    cfg = json.loads(path.read_text())
    n = num_layers if num_layers is not None else int(cfg.get("num_hidden_layers", 1))
    return f"{path} ({n} layers)", with_num_layers(cfg, n)
