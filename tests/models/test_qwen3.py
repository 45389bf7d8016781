"""Qwen3 (dense) vs HF transformers: q/k norm, and mixed full/sliding layers."""

from __future__ import annotations

import json

from deepinfer.models.qwen3 import qwen3_layer_types
from tests.models.conftest import assert_matches_hf, load_ours

MIXED = dict(num_hidden_layers=3, use_sliding_window=True, max_window_layers=1, sliding_window=8,
             head_dim=16)


def windows(model) -> list[int | None]:
    return [layer.kv_spec.sliding_window for layer in model.kv_cache_layers()]


def test_qwen3_full_attention_matches_hf(checkpoint):
    hf_model, ours, _ = checkpoint("Qwen3ForCausalLM", head_dim=16)
    assert windows(ours) == [None, None]
    assert_matches_hf(hf_model, ours, [12, 19, 3])


def test_qwen3_mixed_layer_types_matches_hf(checkpoint):
    hf_model, ours, _ = checkpoint("Qwen3ForCausalLM", **MIXED)
    assert hf_model.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert windows(ours) == [None, 8, 8]
    assert_matches_hf(hf_model, ours, [20, 13, 22])


def test_qwen3_explicit_layer_types_matches_hf(checkpoint):
    """A layer_types list that max_window_layers could not produce is honoured as given."""
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    hf_model, ours, _ = checkpoint("Qwen3ForCausalLM", **MIXED, layer_types=types, seed=3)
    assert windows(ours) == [8, None, 8]
    assert_matches_hf(hf_model, ours, [21, 9])


def test_qwen3_layer_types_derived_when_absent(checkpoint):
    _, _, path = checkpoint("Qwen3ForCausalLM", **MIXED)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg["layer_types"]
    cfg_file.write_text(json.dumps(cfg))
    assert windows(load_ours(path)) == [None, 8, 8]
    assert qwen3_layer_types({**cfg, "use_sliding_window": False}) == ["full_attention"] * 3
