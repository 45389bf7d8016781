"""Mistral vs HF transformers, with sequences longer than the sliding window."""

from __future__ import annotations

import pytest

from tests.models.conftest import assert_matches_hf


@pytest.mark.parametrize("window", [8, None])
def test_mistral_matches_hf(checkpoint, window):
    hf_model, ours, _ = checkpoint("MistralForCausalLM", num_hidden_layers=3, sliding_window=window)
    specs = [layer.kv_spec for layer in ours.kv_cache_layers()]
    assert len(specs) == 3
    assert all(s.sliding_window == window for s in specs)
    assert all(s.kind == ("sliding" if window else "full") for s in specs)
    assert_matches_hf(hf_model, ours, [20, 11, 23])
