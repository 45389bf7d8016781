"""Llama vs HF transformers: logits (single sequence and a flattened batch) and greedy tokens."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from deepinfer.layers.rotary import inv_frequencies, rope_parameters
from tests.models.conftest import assert_matches_hf, transformers

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=32)

VARIANTS = {
    "untied": {},
    "tied": dict(tie_word_embeddings=True),
    "llama3_rope": dict(rope_parameters=LLAMA3_ROPE),
    "linear_rope": dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
    "biases_and_head_dim": dict(attention_bias=True, mlp_bias=True, head_dim=32),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_llama_matches_hf(checkpoint, variant):
    hf_model, ours, _ = checkpoint("LlamaForCausalLM", **VARIANTS[variant])
    assert_matches_hf(hf_model, ours, [9, 21, 4])


def test_tied_checkpoint_has_no_lm_head(checkpoint):
    _, ours, path = checkpoint("LlamaForCausalLM", tie_word_embeddings=True)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_rope_scaling_changes_frequencies(checkpoint):
    """The scaled runs above would pass vacuously if scaling left the frequencies unchanged."""
    hf_model, ours, _ = checkpoint("LlamaForCausalLM", rope_parameters=LLAMA3_ROPE)
    hf_inv_freq = hf_model.model.rotary_emb.inv_freq
    torch.testing.assert_close(ours.model.rotary_emb.inv_freq, hf_inv_freq, rtol=0, atol=0)
    default, _ = inv_frequencies(dict(rope_type="default", rope_theta=10000.0), 16)
    assert not torch.allclose(hf_inv_freq, default)


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_legacy_rope_fields(rope_scaling):
    """Pre-v5 config.json files carry rope_theta and rope_scaling instead of rope_parameters."""
    legacy = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                  rope_theta=500000.0, rope_scaling=rope_scaling)
    hf_config = transformers.LlamaConfig(**legacy)
    hf_rope = transformers.LlamaForCausalLM(hf_config).model.rotary_emb
    ours, scaling = inv_frequencies(rope_parameters(legacy), 16)
    torch.testing.assert_close(ours, hf_rope.inv_freq, rtol=0, atol=0)
    assert scaling == hf_rope.attention_scaling


def test_unsupported_rope_type_is_named():
    with pytest.raises(NotImplementedError, match="rope_type='dynamic'"):
        inv_frequencies(rope_parameters({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}), 16)
