"""Model shapes for ``deepinfer bench prefill | decode | curve --config``.

``--config`` is a preset name or a path to a config.json (or a directory holding
one); ``--num-layers N`` keeps the widths and changes the depth, so one GPU can
measure the real model's per-layer cost. Weights are random (``load_format="dummy"``),
so the config is all a benchmark needs. MTP layers are dropped
(``num_nextn_predict_layers=0``): the engine does not run them yet.

Depth changes (:func:`with_num_layers`):

- DeepSeek-V4: explicit ``layer_types`` / ``compress_ratios`` repeat their main-layer
  pattern; ``mlp_layer_types`` keep their first entries and continue with ``"moe"``.
- DeepSeek-V4.1: a layer's role is set by the layer *ids* the config lists
  (``kv_source_layer_ids``, ``index_source_layer_ids``, ``candidate_source_layer_id``,
  ``engram_layer_ids``), so repeating a pattern would break them. The first N layers are
  kept as they are (ids >= N dropped: a role only reads layers at or below it, so the
  kept layers are unchanged); layers beyond the config's own continue as reuse layers of
  its last layer's ratio (they read the stream and the selection that layer read; window-only
  layers if it is one). The
  result is checked as the model checks it (``DeepseekV41Args.from_hf``).

A release V4.1 config.json (its fields inside ``text_config``) is flattened first.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from deepinfer.config import flatten_text_config
from deepinfer.layers.deepseek_v4_attention import CSA, HCA, SLIDING
from deepinfer.models.deepseek_v41 import DeepseekV41Args

V4_ARCH = "DeepseekV4ForCausalLM"
V41_ARCH = "DeepseekV41ForCausalLM"

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


# DeepSeek-V4.1-Flash widths: the release's text config (deepseek_v41.md §1), without
# engram (its two tables, ~101 GB each in FP8, stay in host memory: dummy ones would take
# ~203 GB of the benchmark host's RAM) and
# without the MTP/DSpark layers. The roles come from v41_roles(N). 4 layers are about
# 56.37B parameters (112.8 GB in bf16), for an H200; 2 layers (57.7 GB) fit an 80 GB card.
_V41_FLASH: dict[str, Any] = {
    "architectures": [V41_ARCH], "model_type": "deepseek_v41",
    "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
    "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
    "sliding_window": 128, "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [], "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "hidden_act": "silu",
    "attention_bias": False, "num_nextn_predict_layers": 0,
}

PRESETS = ("deepseek-v4-flash", "deepseek-v4.1-flash")
# The weight formats each preset's release ships in (its config.json's quantization_config;
# research notes deepseek_v4_arch.md, deepseek_v41.md): dense projections in FP8 e4m3 with UE8M0
# block scales (V4 128 x 128, V4.1 32 x 32), routed experts in FP4 e2m1 with UE8M0 scales per 32.
SHIPPED_QUANTIZATION = {
    "deepseek-v4-flash": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "scale_fmt": "ue8m0", "weight_block_size": [128, 128], "expert_dtype": "fp4"},
    "deepseek-v4.1-flash": {"quant_method": "fp8", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                            "weight_block_size": [32, 32], "expert_dtype": "fp4"},
}
DEFAULT_LAYERS = {"deepseek-v4-flash": 4, "deepseek-v4.1-flash": 4}


def _v4_flash(num_layers: int) -> dict[str, Any]:
    cfg = copy.deepcopy(_V4_FLASH)
    cfg["num_hidden_layers"] = num_layers
    cfg["layer_types"] = [_V4_PATTERN[i % len(_V4_PATTERN)] for i in range(num_layers)]
    cfg["mlp_layer_types"] = ["hash_moe" if i < _V4_HASH_LAYERS else "moe" for i in range(num_layers)]
    return cfg


def v41_roles(num_layers: int) -> dict[str, Any]:
    """The role lists of the V4.1 preset at ``num_layers`` layers: the release's roles, one
    layer each, in the release's order (deepseek_v41.md §2), so that 4 layers hold every
    kind of compressed layer:

    - layer 0: ratio-2 KV source and key owner (release layers 2, 8, 14);
    - layer 1: ratio-2 reuse (3-7, ...);
    - layer 2: ratio-1 KV source, key owner and candidate source (20);
    - layer 3: reindex, ratio 1, restricted to layer 2's candidate blocks (24, 28, ...);
    - layers 4+: ratio-1 reuse of layer 3's selection (25-27, ...).

    Fewer layers keep the first ``num_layers`` of these (a role only reads layers at or
    below it). The release's two window-only layers (0, 1) are left out: a window-only layer's
    work is a subset of every compressed layer's.
    """
    if num_layers < 1:
        raise ValueError(f"--num-layers={num_layers} must be >= 1")
    ratios = [2, 2, 1, 1] + [1] * (num_layers - 4)
    return {"compress_ratios": ratios[:num_layers],
            "kv_source_layer_ids": [i for i in (0, 2) if i < num_layers],
            "index_source_layer_ids": [i for i in (0, 2, 3) if i < num_layers],
            "candidate_source_layer_id": 2 if num_layers > 2 else -1}


def _v41_flash(num_layers: int) -> dict[str, Any]:
    cfg = copy.deepcopy(_V41_FLASH)
    cfg["num_hidden_layers"] = num_layers
    cfg.update(v41_roles(num_layers))
    return cfg


_PRESET_BUILDERS = {"deepseek-v4-flash": _v4_flash, "deepseek-v4.1-flash": _v41_flash}


def _v41_with_num_layers(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """A (flat) V4.1 config at ``num_layers`` layers; see the module docstring."""
    old = int(cfg["num_hidden_layers"])
    # Entries past the main layers describe the MTP/DSpark layers, which are not built.
    ratios = [int(r) for r in cfg.get("compress_ratios") or []][:old]
    if not ratios or len(ratios) < old:
        raise ValueError(f"compress_ratios has {len(ratios)} entries; it needs one per layer "
                         f"(num_hidden_layers={old})")
    ratios = ratios[:num_layers] + [ratios[-1]] * (num_layers - old)
    cfg["compress_ratios"] = ratios
    for key in ("kv_source_layer_ids", "index_source_layer_ids"):
        cfg[key] = [int(i) for i in cfg.get(key) or [] if int(i) < num_layers]
    if int(cfg.get("candidate_source_layer_id", -1)) >= num_layers:
        cfg["candidate_source_layer_id"] = -1
    engram = [int(i) for i in cfg.get("engram_layer_ids") or []]
    keep = [k for k, i in enumerate(engram) if i < num_layers]
    cfg["engram_layer_ids"] = [engram[k] for k in keep]
    if cfg.get("engram_num_embeddings") is not None:    # one table size per engram layer
        cfg["engram_num_embeddings"] = [cfg["engram_num_embeddings"][k] for k in keep]
    cfg["num_hidden_layers"] = num_layers
    DeepseekV41Args.from_hf(cfg)    # a config that was invalid to begin with fails here, clearly
    return cfg


def with_num_layers(hf_config: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """``hf_config`` at depth ``num_layers`` (see the module docstring), without MTP layers."""
    if num_layers < 1:
        raise ValueError(f"--num-layers={num_layers} must be >= 1")
    cfg = copy.deepcopy(flatten_text_config(hf_config))
    if (cfg.get("architectures") or [None])[0] == V41_ARCH:
        cfg = _v41_with_num_layers(cfg, num_layers)
        cfg["num_nextn_predict_layers"] = 0
        return cfg
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


# DeepSeek-V4.1-Flash's DSpark drafter (dspark_module.md §1.1): three stages of 128 experts,
# top-3, a 5-token block and a rank-256 Markov head.
_V41_DSPARK: dict[str, Any] = {
    "num_nextn_predict_layers": 3, "dspark_block_size": 5, "dspark_noise_token_id": 128799,
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
}


def with_dspark(hf_config: dict[str, Any]) -> dict[str, Any]:
    """A DeepSeek-V4.1 config with the release's DSpark drafter added (``bench --spec-method
    dspark``). The release reads the streams entering its last three layers (37-39 of 40
    positions, the final streams being 43); a config of N layers reads positions N-2..N
    (fewer when N < 2), so the drafter's shapes and cost are the release's."""
    if (hf_config.get("architectures") or [None])[0] != V41_ARCH:
        raise ValueError(f"a DSpark drafter runs on DeepSeek-V4.1 ({V41_ARCH}) configs only; this config is "
                         f"{hf_config.get('architectures')}")
    cfg = copy.deepcopy(hf_config)
    cfg.update(_V41_DSPARK)
    n = int(cfg["num_hidden_layers"])
    # The release's noise token, or the last one of a smaller vocabulary.
    cfg["dspark_noise_token_id"] = min(cfg["dspark_noise_token_id"], int(cfg["vocab_size"]) - 1)
    cfg["dspark_target_layer_ids"] = list(range(max(0, n - 2), n + 1))
    return cfg


def resolve_config(config: str, num_layers: int | None = None) -> tuple[str, dict[str, Any]]:
    """(label, HF config dict) for a preset name or a config.json path / model directory."""
    if config in PRESETS:
        n = num_layers if num_layers is not None else DEFAULT_LAYERS[config]
        if n < 1:
            raise ValueError(f"--num-layers={n} must be >= 1")
        return f"{config} ({n} layers)", _PRESET_BUILDERS[config](n)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--config={config!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                                "config.json file or a directory holding one")
    cfg = flatten_text_config(json.loads(path.read_text()))
    n = num_layers if num_layers is not None else int(cfg.get("num_hidden_layers", 1))
    return f"{path} ({n} layers)", with_num_layers(cfg, n)
