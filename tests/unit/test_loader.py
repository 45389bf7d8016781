"""Checkpoint loading: file discovery, sharded checkpoints, strict name/shape checks,
tied embeddings, dtype, and unknown architectures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.config import ModelConfig
from deepinfer.models.loader import checkpoint_files, iter_checkpoint, load_model
from deepinfer.models.registry import get_model_class, supported_architectures
from tests.models.conftest import (CPU, LOGITS_RTOL, hf_logits, load_ours, make_hf_model,
                                   our_logits, random_prompts, rel_err, save)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(hf_model, path of its single-file checkpoint)."""
    hf_model = make_hf_model("LlamaForCausalLM")
    return hf_model, save(hf_model, tmp_path_factory.mktemp("llama") / "ckpt")


def copy_with(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` whose tensor dict went through ``edit``."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def assert_logits_match(hf_model, ours) -> None:
    prompts = random_prompts([11, 6], hf_model.config.vocab_size)
    for got, p in zip(our_logits(ours, prompts), prompts):
        assert rel_err(got, hf_logits(hf_model, p)) <= LOGITS_RTOL


def test_sharded_checkpoint_loads_and_matches(llama, tmp_path):
    hf_model, _ = llama
    path = save(hf_model, tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (path / "model.safetensors").exists()
    assert checkpoint_files(str(path)) == [path / s for s in shards]
    names = [n for n, _ in iter_checkpoint(str(path))]
    assert sorted(names) == sorted(index["weight_map"])
    assert_logits_match(hf_model, load_ours(path))


def test_shards_without_index_are_all_read(llama, tmp_path):
    hf_model, _ = llama
    path = save(hf_model, tmp_path / "sharded", max_shard_size="20KB")
    (path / "model.safetensors.index.json").unlink()
    assert len(checkpoint_files(str(path))) > 1
    assert_logits_match(hf_model, load_ours(path))


def test_no_checkpoint_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors.index.json"):
        list(iter_checkpoint(str(tmp_path)))


def test_index_naming_absent_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        checkpoint_files(str(tmp_path))


def test_missing_tensor_is_named(llama, tmp_path):
    _, src = llama
    path = copy_with(src, tmp_path / "ckpt", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_ours(path)


def test_untied_checkpoint_needs_lm_head(llama, tmp_path):
    _, src = llama
    path = copy_with(src, tmp_path / "ckpt", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_ours(path)


def test_unexpected_tensor_is_named(llama, tmp_path):
    _, src = llama

    def add(t):
        t["model.layers.0.self_attn.rotary.weight"] = torch.randn(4)
    path = copy_with(src, tmp_path / "ckpt", add)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.rotary\.weight"):
        load_ours(path)


def test_misshaped_tensor_is_named_with_both_shapes(llama, tmp_path):
    _, src = llama

    def reshape(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.randn(16, 64)
    path = copy_with(src, tmp_path / "ckpt", reshape)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(16, 64\).*\(32, 64\)"):
        load_ours(path)


def test_partly_missing_experts_are_named(tmp_path):
    hf_model = make_hf_model("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, head_dim=16)
    src = save(hf_model, tmp_path / "src")
    path = copy_with(src, tmp_path / "ckpt",
                     lambda t: t.pop("model.layers.1.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj \(30720 of 32768"):
        load_ours(path)


def test_out_of_range_expert_is_named(tmp_path):
    hf_model = make_hf_model("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, head_dim=16)
    src = save(hf_model, tmp_path / "src")

    def add(t):
        t["model.layers.0.mlp.experts.8.down_proj.weight"] = torch.randn(64, 32)
    path = copy_with(src, tmp_path / "ckpt", add)
    with pytest.raises(ValueError, match=r"experts\.8\.down_proj\.weight.*num_experts=8"):
        load_ours(path)


def test_loads_in_requested_dtype(llama):
    _, path = llama
    config = ModelConfig.from_path(path, "bfloat16", None, CPU)
    model = load_model(config, CPU)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training
    ref = load_file(str(path / "model.safetensors"))["model.norm.weight"]
    assert torch.equal(model.model.norm.weight, ref.to(torch.bfloat16))


def test_unknown_architecture_lists_supported(llama, tmp_path):
    _, src = llama
    path = copy_with(src, tmp_path / "ckpt", lambda t: None)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3MoeForCausalLM"):
        load_ours(path)
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
            "DeepseekV3ForCausalLM", "DeepseekV4ForCausalLM", "DeepseekV41ForCausalLM"} == set(supported_architectures())
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"


def test_mapped_tensors_are_read_only_maps_of_the_file():
    """``iter_checkpoint(mapped=...)``: the named tensors come as read-only shared maps of their
    bytes in the file (what the host-memory engram tables keep), equal to the loaded ones."""
    path = Path(__file__).resolve().parents[1] / "data" / "v41_reference" / "checkpoint"
    loaded = dict(iter_checkpoint(str(path)))
    mapped = dict(iter_checkpoint(str(path), mapped=lambda name: ".engram." in name or name.startswith("embed")))
    assert loaded.keys() == mapped.keys()
    names = [n for n in loaded if ".engram." in n or n.startswith("embed")]
    assert {str(loaded[n].dtype) for n in names} >= {"torch.float8_e4m3fn", "torch.float8_e8m0fnu",
                                                      "torch.bfloat16"}
    with open("/proc/self/maps") as f:
        maps = [line.split() for line in f]
    for name in names:
        a, b = loaded[name], mapped[name]
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), name
        address = b.data_ptr()
        spans = [(int(lo, 16), int(hi, 16), m[1]) for m in maps for lo, hi in [m[0].split("-")]]
        perms = [p for lo, hi, p in spans if lo <= address < hi]
        assert perms == ["r--s"], name
