"""ModelConfig: the DeepSeek-V4.1 release wrapper (``text_config``) is flattened."""

from __future__ import annotations

import json

import torch

from deepinfer.config import ModelConfig, flatten_text_config

CPU = torch.device("cpu")
QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
         "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
TEXT = {"model_type": "deepseek_v41_text", "vocab_size": 320, "hidden_size": 64,
        "num_hidden_layers": 8, "max_position_embeddings": 4096, "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1], "bos_token_id": 7}
RELEASE = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
           "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
           "image_token_id": 129264, "quantization_config": QUANT, "text_config": TEXT,
           "vision_config": {"hidden_size": 32, "num_hidden_layers": 2}}


def test_release_wrapper_is_flattened(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASE))
    config = ModelConfig.from_path(tmp_path, "float32", None, CPU)
    cfg = config.hf_config
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "sliding_window", "compress_ratios"):
        assert cfg[key] == TEXT[key], key
    # The outer identity, quantisation, special tokens and dtype win over the inner ones.
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v41"
    assert cfg["quantization_config"] == QUANT
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 2)
    assert cfg["dtype"] == "bfloat16"
    for dropped in ("text_config", "vision_config", "image_token_id"):
        assert dropped not in cfg, dropped
    # Properties and defaults read the text model's fields.
    assert config.architecture == "DeepseekV41ForCausalLM"
    assert config.vocab_size == 320
    assert config.max_model_len == 4096
    assert config.config_eos_token_ids == {1}


def test_flattening_applies_to_direct_construction_and_is_idempotent():
    config = ModelConfig(path="x", hf_config=RELEASE, dtype=torch.float32, max_model_len=16)
    assert "text_config" not in config.hf_config and config.vocab_size == 320
    assert flatten_text_config(config.hf_config) == config.hf_config
    assert RELEASE["text_config"] is TEXT and "vision_config" in RELEASE   # the input is not edited


def test_other_architectures_are_unchanged():
    plain = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 96, "hidden_size": 64}
    assert ModelConfig.from_hf_config(plain, "x", "float32", None, CPU).hf_config == plain
    # A text_config under another architecture (e.g. a multimodal Mistral) is left alone.
    nested = {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {"vocab_size": 9}}
    assert flatten_text_config(nested) is nested
