"""Random ("dummy") weights and the engine built on them: seeded per tensor name, never
zeros, scaled; HF transformers' model gets the same values; the tokenizer-free engine;
the finite-activation check; model shapes and depth overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer.bench.common import check_finite
from deepinfer.bench.hf_baseline import HFBaseline, fit_context
from deepinfer.bench.model_shapes import resolve_config, with_num_layers
from deepinfer.engine.engine import Engine
from deepinfer.entrypoints.llm import build_engine_config
from deepinfer.forward_context import ForwardContext
from deepinfer.models.deepseek_v4 import DeepseekV4Args, DeepseekV4ForCausalLM
from deepinfer.models.dummy import fill_dummy_, init_dummy_weights
from deepinfer.sampling_params import SamplingParams

from .. import TINY_V4_MODEL

CPU = torch.device("cpu")
SL, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@pytest.fixture(scope="module")
def tiny_config() -> dict:
    """The tiny DeepSeek-V4's config at 2 layers: one CSA, one HCA (ratio 16), the first hash-routed."""
    cfg = json.loads((Path(TINY_V4_MODEL) / "config.json").read_text())
    return {**with_num_layers(cfg, 2), "layer_types": [CSA, HCA]}


def dummy_model(cfg: dict, seed: int) -> DeepseekV4ForCausalLM:
    model = DeepseekV4ForCausalLM(cfg, torch.float32).eval()
    init_dummy_weights(model, seed)
    return model


def test_dummy_weights_are_seeded_by_name_and_never_zero(tiny_config):
    a, b, c = dummy_model(tiny_config, 0), dummy_model(tiny_config, 0), dummy_model(tiny_config, 1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    for name, t in sa.items():
        assert torch.equal(t, sb[name]), name
        assert not torch.equal(t, sc[name]), name
        if t.is_floating_point():
            assert (t != 0).float().mean() > 0.99, name
            assert t.numel() == 1 or t.std() > 0, name
    # Scales: matrices N(0, 1/fan_in), norm weights around 1, the routing bias near 0.
    w = sa["model.layers.0.self_attn.q_b_proj.weight"]
    assert w.std().item() == pytest.approx(w.shape[1] ** -0.5, rel=0.1)
    assert sa["model.layers.0.input_layernorm.weight"].mean().item() == pytest.approx(1.0, abs=0.1)
    assert sa["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() < 0.1
    # Hash routing: K distinct expert ids per token, all experts in use.
    table = sa["model.layers.0.mlp.gate.tid2eid"]
    experts = tiny_config["n_routed_experts"]
    assert table.min() >= 0 and table.max() < experts
    assert all(len(set(row)) == table.shape[1] for row in table.tolist())
    assert len(table.unique()) == experts


def test_dummy_fill_is_chunk_independent_of_model():
    """The same name and seed give the same values in any tensor of that shape."""
    x, y = torch.empty(3, 5), torch.empty(3, 5)
    fill_dummy_(x, "a.weight", 7)
    fill_dummy_(y, "a.weight", 7)
    assert torch.equal(x, y)
    fill_dummy_(y, "b.weight", 7)
    assert not torch.equal(x, y)
    with pytest.raises(NotImplementedError, match="integer tensor 'x.ids'"):
        fill_dummy_(torch.empty(2, 2, dtype=torch.long), "x.ids", 0)
    with pytest.raises(ValueError, match="needs num_experts >= 4"):
        fill_dummy_(torch.empty(2, 4, dtype=torch.long), "gate.tid2eid", 0, num_experts=3)


def test_hf_baseline_gets_the_same_weights(tiny_config):
    """HF's model refilled under our names computes our logits."""
    hf_cfg = {**tiny_config, "tie_word_embeddings": False}
    ours = dummy_model(hf_cfg, seed=3)
    hf = HFBaseline(hf_cfg, torch.float32, CPU, seed=3)
    ids = torch.randint(0, hf_cfg["vocab_size"], (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf.model(input_ids=ids[None], use_cache=False).logits[0]
        got = ours.compute_logits(ours(ids, ForwardContext.no_cache([40], CPU)))
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4
    hf.close()


def test_fit_context_bounds_eager_attention_memory():
    assert fit_context(batch=1, context=4096, num_heads=64, free_bytes=80 << 30) == 4096
    short = fit_context(batch=64, context=4096, num_heads=64, free_bytes=80 << 30)
    assert 0 < short < 4096 and short % 64 == 0
    assert 64 * 64 * short ** 2 * 15 <= 40 << 30 < 64 * 64 * (short + 64) ** 2 * 15
    assert fit_context(batch=1, context=4096, num_heads=64, free_bytes=1 << 20) == 0


def test_engine_on_dummy_weights_without_tokenizer(tiny_config):
    config = build_engine_config("tiny", hf_config=tiny_config, load_format="dummy", skip_tokenizer_init=True,
                                 device="cpu", seed=5, max_num_batched_tokens=64, cpu_kv_cache_bytes=8 << 20)
    engine = Engine(config)
    assert engine.tokenizer is None
    ref = dummy_model(tiny_config, seed=5)
    assert torch.equal(engine.model.state_dict()["model.layers.1.mlp.experts.down_proj"],
                       ref.state_dict()["model.layers.1.mlp.experts.down_proj"])
    with pytest.raises(ValueError, match="no tokenizer.*token ids"):
        engine.add_request("some text", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="stop strings"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, stop=["x"]))
    rid = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert outs[-1].outputs[0].text == ""
    with pytest.raises(ValueError, match="load_format='bogus'"):
        build_engine_config("tiny", hf_config=tiny_config, load_format="bogus", device="cpu")


def test_check_finite_names_the_layer(tiny_config):
    model = dummy_model(tiny_config, seed=0)
    check_finite(model, CPU, tiny_config["vocab_size"], seed=0)
    with torch.no_grad():
        model.model.layers[1].self_attn.o_b_proj.weight[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite activations at the output of model.layers.1"):
        check_finite(model, CPU, tiny_config["vocab_size"], seed=0)


def test_presets_and_depth_overrides(tmp_path):
    label, cfg = resolve_config("deepseek-v4-flash", 6)
    assert label == "deepseek-v4-flash (6 layers)"
    args = DeepseekV4Args.from_hf(cfg)
    assert args.layer_types == (SL, CSA, HCA, CSA, SL, CSA)
    assert args.mlp_layer_types == ("hash_moe",) + ("moe",) * 5
    assert args.num_mtp_layers == 0
    # HF transformers resolves the preset the same way (layer types, routing types, rope).
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    hf_args = DeepseekV4Args.from_hf(DeepseekV4Config(**json.loads(json.dumps(cfg))).to_dict())
    assert hf_args.layer_types[: args.num_layers] == args.layer_types
    assert hf_args.mlp_layer_types[: args.num_layers] == args.mlp_layer_types
    assert hf_args.rope_parameters == args.rope_parameters
    # A DeepSeek-style config.json deepened: compress_ratios repeat, hash layers stay first, MTP dropped.
    native = {"architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 3, "num_hash_layers": 1,
              "compress_ratios": [0, 4, 128, 0], "num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(native))
    _, deep = resolve_config(str(tmp_path), 5)
    assert deep["compress_ratios"] == [0, 4, 128, 0, 4] and deep["num_nextn_predict_layers"] == 0
    deep_args = DeepseekV4Args.from_hf(deep)
    assert deep_args.layer_types == (SL, CSA, HCA, SL, CSA)
    assert deep_args.mlp_layer_types == ("hash_moe",) + ("moe",) * 4
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        resolve_config(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="--num-layers=0"):
        resolve_config("deepseek-v4-flash", 0)
