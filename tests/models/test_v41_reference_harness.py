"""The DeepSeek-V4.1 test harness (tests/models/v41_reference.py) checks itself.

- The tiny config has every layer role, and top-k, candidate blocks, the SwiGLU clamp
  and gate_temp all change the output (so a comparison would notice them wrong).
- The tensors have the release's names, shapes and storage dtypes (those of the
  reference checkpoint in shared/testdata/v41_reference).
- A quantised checkpoint written to disk, one file or sharded, reads back through the
  engine's loader as exactly ``dequantized(...)``; mlx-lm's own loader, reading the FP8
  and FP4 bytes as mxfp8/mxfp4, gives the same values and logits.
- mlx-lm's full forward, its cached path (chunked, token by token) and its greedy
  decoding agree, with its fake quantisation off.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from deepinfer.config import ModelConfig
from deepinfer.models.loader import checkpoint_files, iter_checkpoint, iter_weights
from tests.models.v41_reference import (REFERENCE_CHECKPOINT, MlxV41, dequantized, quantize_release,
                                        random_v41_weights, storage_format, tiny_v41_text_config,
                                        v41_weight_shapes, write_checkpoint)

pytest.importorskip("mlx_lm.models.deepseek_v41")
import mlx.core as mx  # noqa: E402
from mlx_lm.models import deepseek_v41 as mlx_v41  # noqa: E402

CPU = torch.device("cpu")
CACHE_ATOL = 1e-4          # research note §13: 7.5e-6 measured, fake quantisation off
PROMPT_LENS = (40, 43)     # 20-21 ratio-2 entries and 40-43 ratio-1 entries > index_topk=6


def prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def config() -> dict:
    return tiny_v41_text_config()


@pytest.fixture(scope="module")
def weights(config) -> dict[str, torch.Tensor]:
    return random_v41_weights(config, seed=0)


@pytest.fixture(scope="module")
def qweights(weights) -> dict[str, torch.Tensor]:
    return quantize_release(weights)


@pytest.fixture(scope="module")
def ref(config, qweights) -> MlxV41:
    return MlxV41(config, dequantized(qweights))


def test_tiny_config_has_every_layer_role(config, ref):
    roles = []
    for i, layer in enumerate(ref.model.layers):
        attn = layer.self_attn
        compressor = getattr(attn, "compressor", None)
        indexer = getattr(attn, "indexer", None)
        roles.append((
            attn.ratio,
            None if compressor is None else hasattr(compressor, "gate_proj"),
            None if indexer is None else hasattr(indexer, "k_proj"),
            indexer is not None and indexer.is_candidate_source,
            mlx_v41._shared_reads(ref.model.args, i).get("topk_idx"),
        ))
    assert roles == [
        (0, None, None, False, None), (0, None, None, False, None),   # window only
        (2, True, True, False, None), (2, None, None, False, 2),      # ratio-2 source, its reuse
        (2, True, True, False, None), (2, None, None, False, 4),      # a second ratio-2 source
        (1, False, True, True, None), (1, None, None, False, 6),      # ratio-1 candidate source
        (1, None, False, False, None), (1, None, None, False, 8),     # reindex (no keys), its reuse
    ]
    assert mlx_v41._shared_reads(ref.model.args, 8) == {"compress_kv": 6, "index_k": 6, "candidates": 6}
    assert (config["candidate_topk_blocks"] - 1) * config["candidate_block_size"] + 1 >= config["index_topk"]
    assert ref.model.args.gate_temp == config["gate_temp"] != 1.0


@pytest.mark.parametrize("override", [
    dict(swiglu_limit=100.0),                               # the clamp is active
    dict(index_topk=64, candidate_topk_blocks=17),          # the top-k selects
    dict(candidate_topk_blocks=0),                          # the candidate blocks restrict
    dict(gate_temp=1.0),
])
def test_tiny_config_paths_change_the_output(config, qweights, ref, override):
    prompt = prompts(config["vocab_size"])[0]
    other = MlxV41(tiny_v41_text_config(**override), dequantized(qweights))
    assert np.abs(other.logits(prompt) - ref.logits(prompt)).max() > 0.1


def test_names_shapes_and_dtypes_mirror_the_reference_checkpoint(qweights):
    """On the reference checkpoint's own text_config (its engram layers off), the harness
    writes exactly the reference's non-engram, non-MTP tensors, shapes and dtypes."""
    release = json.loads((REFERENCE_CHECKPOINT / "config.json").read_text())
    text = {**release["text_config"], "engram_layer_ids": []}
    with safe_open(str(REFERENCE_CHECKPOINT / "model.safetensors"), framework="pt") as f:
        want = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape())) for n in f.keys()
                if ".engram." not in n and not n.startswith("mtp.")}
    ours = quantize_release(random_v41_weights(text, seed=3))
    dtype_names = {torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8",
                   torch.bfloat16: "BF16", torch.float32: "F32"}
    assert {n: (dtype_names[t.dtype], tuple(t.shape)) for n, t in ours.items()} == want
    # The tiny config's tensors are stored the same way, by name.
    assert {storage_format(n) for n in qweights if not n.endswith(".scale")} == {"fp8", "fp4", "f32", "bf16"}


def _assert_loads_as_dequantized(path, qweights) -> None:
    hf_config = ModelConfig.from_path(path, "float32", None, CPU).hf_config
    loaded = dict(iter_weights(str(path), hf_config))
    want = dequantized(qweights)
    assert loaded.keys() == want.keys()
    for name, t in want.items():
        fmt = storage_format(name)
        assert loaded[name].dtype == (torch.bfloat16 if fmt == "bf16" else torch.float32), name
        assert torch.equal(loaded[name].float(), t), name


def test_quantized_checkpoint_reads_back_exactly(tmp_path, config, weights, qweights):
    path = write_checkpoint(tmp_path / "ckpt", config, qweights)
    assert [p.name for p in checkpoint_files(str(path))] == ["model.safetensors"]
    stored = dict(iter_checkpoint(str(path)))
    assert {n: t.dtype for n, t in stored.items()} == {n: t.dtype for n, t in qweights.items()}
    assert stored["layers.2.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    _assert_loads_as_dequantized(path, qweights)

    # The stored values are the weights up to the formats' rounding: a wrong tile, group or
    # nibble order would be far off. FP8: half a step of the top binade, 16/224 of the tile's
    # absmax; FP4 (steps of 2 between 4 and 6 at absmax/scale > 3): 1/3 of the group's absmax.
    deq = dequantized(qweights)
    bounds = {"fp8": 1 / 14, "fp4": 1 / 3, "bf16": 2.0 ** -8, "f32": 0.0}
    for name, w in weights.items():
        err = (deq[name] - w).abs().max().item()
        assert err <= bounds[storage_format(name)] * w.abs().max().item(), (name, err)

    # ModelConfig flattened the release wrapper, and the engine's tokenizer files are there.
    model_config = ModelConfig.from_path(path, "float32", None, CPU)
    assert model_config.architecture == "DeepseekV41ForCausalLM"
    assert model_config.hf_config["quantization_config"]["weight_block_size"] == [32, 32]
    assert model_config.hf_config["num_hidden_layers"] == config["num_hidden_layers"]
    assert json.loads((path / "tokenizer.json").read_text())["model"]["type"] == "BPE"


def test_sharded_checkpoint_reads_back_exactly(tmp_path, config, qweights):
    path = write_checkpoint(tmp_path / "sharded", config, qweights, shards=3)
    assert not (path / "model.safetensors").exists()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = checkpoint_files(str(path))
    assert [p.name for p in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert index["weight_map"].keys() == qweights.keys()
    for name, file in index["weight_map"].items():     # a weight and its scale share a file
        if name.endswith(".scale"):
            assert index["weight_map"][name.removesuffix(".scale") + ".weight"] == file, name
    _assert_loads_as_dequantized(path, qweights)


def test_mlx_reads_the_quantized_checkpoint_the_same_way(tmp_path, config, qweights, ref):
    """mlx-lm's loader keeps the FP8/FP4 bytes as mxfp8/mxfp4 QuantizedLinears: an
    independent decoder of the formats that quantize_release writes."""
    path = write_checkpoint(tmp_path / "ckpt", config, qweights)
    packed = MlxV41.from_checkpoint(path)
    deq = dequantized(qweights)
    q_b = packed.model.layers[2].self_attn.q_b_proj
    up = packed.model.layers[3].mlp.experts.switch_mlp.up_proj
    assert (q_b.mode, up.mode) == ("mxfp8", "mxfp4")
    for module, bits, mode, want in (
            (q_b, 8, "mxfp8", deq["layers.2.attn.wq_b.weight"]),
            (up, 4, "mxfp4", torch.stack([deq[f"layers.3.ffn.experts.{e}.w3.weight"]
                                          for e in range(config["n_routed_experts"])]))):
        got = mx.dequantize(module.weight, module.scales, group_size=32, bits=bits, mode=mode,
                            dtype=mx.float32)
        assert np.array_equal(np.array(got), want.numpy()), mode
    for prompt in prompts(config["vocab_size"]):
        assert np.abs(packed.logits(prompt) - ref.logits(prompt)).max() <= CACHE_ATOL


def test_full_forward_matches_cached_paths(config, ref):
    for b, prompt in enumerate(prompts(config["vocab_size"])):
        full = ref.logits(prompt)
        assert full.shape == (len(prompt), config["vocab_size"]) and full.dtype == np.float32
        assert 0.5 < full.std() < 10.0                      # activations stay O(1)
        for chunk in (None, 7, 1) if b == 0 else (None, 5):
            err = np.abs(ref.cached_logits(prompt, chunk) - full).max()
            assert err <= CACHE_ATOL, (b, chunk, err)


def test_greedy_matches_repeated_full_forwards(config, ref):
    prompt = prompts(config["vocab_size"])[1]
    n = 6
    want, seq = [], list(prompt)
    for _ in range(n):
        want.append(int(ref.logits(seq)[-1].argmax()))
        seq.append(want[-1])
    assert ref.greedy(prompt, n) == want
    assert ref.greedy(prompt, n, chunk=9) == want
    assert ref.greedy(prompt, 0) == []


def test_fake_quant_switch(config, ref):
    prompt = prompts(config["vocab_size"])[0]
    functions = mlx_v41._fake_quant_fp8, mlx_v41._fake_quant_fp4
    off = ref.logits(prompt)
    ref.fake_quant = True
    try:
        on = ref.logits(prompt)
    finally:
        ref.fake_quant = False
    assert np.abs(on - off).max() > 1e-3                        # the rounding ran
    assert (mlx_v41._fake_quant_fp8, mlx_v41._fake_quant_fp4) == functions   # and was restored
    assert np.array_equal(ref.logits(prompt), off)
