"""Qwen3-MoE vs HF transformers: 8 experts, top-2, dense layers mixed in."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from deepinfer.layers.mlp import GatedMLP
from deepinfer.layers.moe import FusedMoE
from tests.models.conftest import assert_matches_hf, load_ours, make_hf_model, save

MOE = dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           head_dim=16)


def mlp_kinds(model) -> list[type]:
    return [type(layer.mlp.experts if hasattr(layer.mlp, "experts") else layer.mlp)
            for layer in model.model.layers]


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_matches_hf(checkpoint, norm_topk_prob):
    hf_model, ours, _ = checkpoint("Qwen3MoeForCausalLM", **MOE, mlp_only_layers=[1],
                                   norm_topk_prob=norm_topk_prob)
    assert mlp_kinds(ours) == [FusedMoE, GatedMLP, FusedMoE]
    assert_matches_hf(hf_model, ours, [17, 6, 24])


def test_qwen3_moe_sparse_step_matches_hf(checkpoint):
    hf_model, ours, _ = checkpoint("Qwen3MoeForCausalLM", **MOE, decoder_sparse_step=2,
                                   norm_topk_prob=True)
    assert mlp_kinds(ours) == [GatedMLP, FusedMoE, GatedMLP]
    assert_matches_hf(hf_model, ours, [15, 8])


def test_qwen3_moe_stacked_expert_checkpoint(tmp_path):
    """HF's in-memory layout (mlp.experts.gate_up_proj [E, 2I, H]) loads as well as per-expert tensors."""
    hf_model = make_hf_model("Qwen3MoeForCausalLM", **MOE, mlp_only_layers=[1], norm_topk_prob=True)
    path = save(hf_model, tmp_path / "stacked", save_original_format=False)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    ours = load_ours(path)
    assert_matches_hf(hf_model, ours, [10, 19])
