"""DeepSeek-V4.1 against DeepSeek's official V4.1 reference inference code: the tiny
engram checkpoint of tests/data/v41_reference (README there) and the logits, greedy
continuations and engram row ids that code produced for it.

The unrounded variant (``_noquant``: no KV, indexer or GEMM-input rounding) is the one
with tight bounds: FP8/FP4 rounding is discontinuous, so a 1e-7 difference can flip one
rounding and move later logits by O(1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.models.deepseek_v41 import layer_roles
from deepinfer.models.loader import load_model

DATA = Path(__file__).resolve().parent.parent / "data" / "v41_reference"
CKPT = DATA / "checkpoint"


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    return dict(np.load(DATA / "expected.npz"))


def prompts(expected: dict[str, np.ndarray]) -> list[list[int]]:
    ids, off = expected["prompt_ids"], expected["prompt_offsets"]
    return [ids[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]


def load(kv_cache_dtype: str):
    cfg = ModelConfig.from_path(CKPT, "float32", None, torch.device("cpu"), kv_cache_dtype=kv_cache_dtype)
    return load_model(cfg, torch.device("cpu"))


@pytest.fixture(scope="module")
def model():
    return load("float32")


@torch.no_grad()
def full_logits(model, ids: list[int]) -> np.ndarray:
    ctx = ForwardContext.no_cache([len(ids)], torch.device("cpu"))
    return model.compute_logits(model(torch.tensor(ids), ctx)).numpy()


def test_roles_follow_the_config():
    import json
    cfg = json.loads((CKPT / "config.json").read_text())["text_config"]
    kinds = [r.kind for r in layer_roles(cfg)]
    assert kinds == ["window", "window", "source", "reuse", "source", "reuse", "reindex", "reuse"]
    roles = layer_roles(cfg)
    assert roles[4].candidate_source and roles[6].restricted and roles[6].keys_from == 4
    assert roles[7].topk_from == 6 and roles[7].entries_from == 4 and roles[3].topk_from == 2


@pytest.mark.parametrize("change, message", [
    ({"kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 6]}, "must also index"),
    ({"candidate_topk_blocks": 2, "candidate_block_size": 2}, "candidate capacity"),
    ({"compress_ratios": [0, 0, 2, 3, 1, 1, 1, 1]}, "compress_ratios has"),
])
def test_config_invariants_are_checked(change, message):
    import json
    cfg = {**json.loads((CKPT / "config.json").read_text())["text_config"], **change}
    with pytest.raises(ValueError, match=message):
        layer_roles(cfg)


def test_logits_match_the_official_reference(model, expected):
    off = expected["prompt_offsets"]
    for i, ids in enumerate(prompts(expected)):
        ref = expected["logits_noquant"][off[i]:off[i + 1]]
        np.testing.assert_allclose(full_logits(model, ids), ref, atol=1e-4, rtol=0)


def test_greedy_matches_the_official_reference(model, expected):
    # Repeated full forwards, as the reference made them (the engine's cached decode is
    # checked on every prompt in tests/engine/test_deepseek_v41_engine.py).
    for i, ids in list(enumerate(prompts(expected)))[:3]:
        seq = list(ids)
        for _ in range(expected["greedy_noquant"].shape[1]):
            seq.append(int(full_logits(model, seq)[-1].argmax()))
        assert seq[len(ids):] == expected["greedy_noquant"][i].tolist(), f"prompt {i}"


def test_release_kv_rounding_stays_close(expected):
    # The reference's `_noact` variant rounds the KV, index keys and queries as the release
    # does (not the GEMM inputs); rounding flips make exact bounds meaningless, so check
    # that most positions agree closely and the argmax mostly matches.
    rounded = load("auto")
    off = expected["prompt_offsets"]
    agree = total = 0
    for i, ids in enumerate(prompts(expected)):
        got = full_logits(rounded, ids)
        ref = expected["logits_noact"][off[i]:off[i + 1]]
        agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ids)
    assert agree / total > 0.9


def _copy_with(tmp_path: Path, extra: dict[str, torch.Tensor]) -> Path:
    """The reference checkpoint with ``extra`` tensors added to its file."""
    import shutil

    from safetensors.torch import load_file, save_file
    out = tmp_path / "ckpt"
    shutil.copytree(CKPT, out)
    tensors = load_file(str(CKPT / "model.safetensors"))
    save_file({**tensors, **extra}, str(out / "model.safetensors"))
    return out


def _load_dir(path: Path):
    cfg = ModelConfig.from_path(path, "float32", None, torch.device("cpu"), kv_cache_dtype="float32")
    return load_model(cfg, torch.device("cpu"))


def test_vision_tensors_are_skipped_and_drafter_tensors_kept(tmp_path, caplog):
    path = _copy_with(tmp_path, {"vision.patch.weight": torch.randn(4, 4), "aligner.proj.weight": torch.randn(2, 2),
                                 "layers.3.ffn.gate.bias_vl": torch.randn(8)})
    with caplog.at_level("INFO", logger="deepinfer.models.deepseek_v41"):
        model = _load_dir(path)
    assert "skipped 3 vision tensor(s)" in caplog.text and "text-only" in caplog.text
    assert "mtp.1.markov_head.embed.weight" in model.drafter_tensors
    # Quantised drafter weights arrive dequantised, with their scales consumed.
    assert model.drafter_tensors["mtp.0.attn.wq_a.weight"].dtype == torch.float32
    assert not any(name.endswith(".scale") for name in model.drafter_tensors)


@pytest.mark.parametrize("extra, message", [
    ({"layers.2.attn.mystery.weight": torch.randn(3)}, "layers.2.attn.mystery.weight"),
    ({"layers.3.attn.compressor.wkv.weight": torch.randn(64, 64)}, "layers.3.attn.compressor.wkv.weight"),
])
def test_unknown_tensors_are_named(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        _load_dir(_copy_with(tmp_path, extra))


def test_mis_shaped_tensors_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.attn_sink.*shape \(5,\)"):
        _load_dir(_copy_with(tmp_path, {"layers.0.attn.attn_sink": torch.randn(5)}))


def test_load_weights_takes_the_fp8_block_its_config_names():
    # The release's blocks are 32 x 32; a config naming 16 x 16 must be dequantised per 16.
    from deepinfer.config import flatten_text_config
    from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
    from tests.models.v41_reference import (dequantized, quantize_fp8_block, random_v41_weights, release_config,
                                            storage_format, tiny_v41_text_config)

    text = tiny_v41_text_config()
    weights = random_v41_weights(text, seed=3)
    qweights = {}
    for name, t in weights.items():
        if storage_format(name) == "fp8":
            q, s = quantize_fp8_block(t, block=16)
            qweights[name], qweights[name.removesuffix(".weight") + ".scale"] = q, s
        else:
            qweights[name] = t
    cfg = flatten_text_config(release_config(text))
    cfg["quantization_config"] = {**(cfg.get("quantization_config") or {}), "weight_block_size": [16, 16]}
    model = DeepseekV41ForCausalLM(cfg, torch.float32)
    model.load_weights(iter(qweights.items()))
    expected = dequantized(qweights, fp8_block=16)["layers.0.attn.wq_a.weight"]
    loaded = next(p for n, p in model.named_parameters() if n.endswith("layers.0.self_attn.q_a_proj.weight")
                  or n.endswith("layers.0.attn.wq_a.weight"))
    assert torch.equal(loaded, expected)
