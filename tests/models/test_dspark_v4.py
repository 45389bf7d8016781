"""DeepSeek-V4's own DSpark drafter (V4-Flash-0731, V4-Flash-DSpark; models/dspark.py, variant
"v4"). No official V4 DSpark outputs exist offline, so: a tiny checkpoint in the shipped names
and formats loads, every tensor is consumed and a wrong one is named; each difference from
V4.1 (capture-after target layers, the KV rounding of the non-rope part per 64, the per-head
q RMS, the hc_head collapse) is checked against a few-line re-implementation here on random
data; the loader trap (``mtp.*`` of a DSpark checkpoint are not MTP layers) holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.kernels import backend
from deepinfer.models.deepseek_v4 import FeatureCapture
from deepinfer.models.dspark import DSparkDrafter, round_v4_kv, window_positions
from deepinfer.models.loader import load_model
from deepinfer.models.quant import pair_scales

from .v4_dspark_checkpoint import (BLOCK, STAGES, TARGET_LAYERS, dspark_config, random_tensors, shipped_shapes,
                                   write_checkpoint)

CPU = torch.device("cpu")


def load(path: Path, kv_cache_dtype: str = "auto"):
    return load_model(ModelConfig.from_path(path, "float32", None, CPU, kv_cache_dtype=kv_cache_dtype), CPU)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("v4dspark") / "ckpt")


@pytest.fixture(scope="module")
def target(checkpoint):
    return load(checkpoint)


@pytest.fixture(scope="module")
def drafter(target) -> DSparkDrafter:
    return DSparkDrafter.from_target(target)


def test_the_shipped_tensors_load_and_are_all_consumed(target, drafter):
    # The HF config says 1 MTP layer; the 3 stages are counted from the tensors, and no MTP
    # layer is built for them (a prefix-remapping MTP loader would half-load them).
    assert len(target.mtp) == 0
    cfg = drafter.cfg
    assert (cfg.variant, cfg.num_stages, cfg.block_size) == ("v4", STAGES, BLOCK)
    assert cfg.target_layer_ids == tuple(i + 1 for i in TARGET_LAYERS) == (2, 3, 4)
    assert cfg.n_routed_experts == 8 and cfg.rope_dim == 16 and cfg.rope_theta == 10000.0
    # Every shipped tensor (scales included) reaches the drafter: the loader's stream kept
    # them all, and the drafter's strict load took them (a missing one raises).
    assert set(target.drafter_tensors) == set(shipped_shapes(dspark_config()))
    fresh = random_tensors(dspark_config())
    last = f"mtp.{STAGES - 1}."
    assert torch.equal(drafter.markov.embed, fresh[last + "markov_head.markov_w1.weight"])
    assert torch.equal(drafter.markov.head, fresh[last + "markov_head.markov_w2.weight"])
    assert torch.equal(drafter.hc_head.hc_fn, fresh[last + "hc_head_fn"])
    assert torch.equal(drafter.confidence.weight, fresh[last + "confidence_head.proj.weight"])
    assert torch.equal(drafter.stages[1].self_attn.sinks, fresh["mtp.1.attn.attn_sink"])
    # FP8 / FP4 tensors arrive dequantised, within their rounding of the written values.
    torch.testing.assert_close(drafter.main_proj.weight, fresh["mtp.0.main_proj.weight"], atol=0, rtol=2 ** -3)
    assert not torch.equal(drafter.main_proj.weight, fresh["mtp.0.main_proj.weight"])


def test_wrong_tensors_are_named(target):
    tensors = dict(pair_scales(target.drafter_tensors.items()))

    def load_with(change: dict, drop: str | None = None) -> None:
        given = {k: v for k, v in {**tensors, **change}.items() if k != drop}
        DSparkDrafter(DSparkDrafter.from_target(target).cfg, target.model.embed_tokens,
                      target.lm_head).load_weights(given.items())

    with pytest.raises(ValueError, match=r"mtp\.1\.attn\.wkv\.weight.*shape \(64, 64\)"):
        load_with({"mtp.1.attn.wkv.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=r"mtp\.2\.markov_head\.markov_w2\.weight.*shape"):
        load_with({"mtp.2.markov_head.markov_w2.weight": torch.zeros(1000, 8)})
    with pytest.raises(ValueError, match=r"mtp\.0\.main_proj\.weight.*shape"):
        load_with({"mtp.0.main_proj.weight": torch.zeros(128, 256)})          # 2 target layers, not 3
    with pytest.raises(ValueError, match=r"hc_head\.hc_base"):
        load_with({}, drop="mtp.2.hc_head_base")                               # missing: named
    with pytest.raises(ValueError, match=r"mtp\.1\.hc_head_fn.*stage 2"):
        load_with({"mtp.1.hc_head_fn": tensors["mtp.2.hc_head_fn"]})           # the head is the last stage's
    with pytest.raises(ValueError, match=r"mtp\.0\.ffn\.gate\.bias_vl"):
        load_with({"mtp.0.ffn.gate.bias_vl": torch.zeros(8)})                  # V4 ships none
    with pytest.raises(ValueError, match=r"mtp\.3\.attn_norm\.weight.*stage 3.*3"):
        load_with({"mtp.3.attn_norm.weight": torch.ones(128)})                # a stage the drafter lacks
    with pytest.raises(ValueError, match=r"mtp\.0\.markov_head\.embed\.weight"):
        load_with({"mtp.0.markov_head.embed.weight": torch.zeros(1000, 16)})   # V4.1's name


def test_loader_trap_and_configs_without_dspark(target, tmp_path):
    from deepinfer.config import SpeculativeConfig
    from deepinfer.spec.dspark import DSparkEngineDrafter
    from deepinfer.spec.mtp import MTPEngineDrafter

    with pytest.raises(NotImplementedError, match="DSpark drafter.*method='dspark'"):
        MTPEngineDrafter.for_model(SpeculativeConfig(method="mtp", num_speculative_tokens=2), target)
    with pytest.raises(NotImplementedError, match="DSpark drafter.*method='dspark'"):
        target.mtp_forward(torch.zeros(1, 4, 128), torch.zeros(1, dtype=torch.long), None)
    config = dspark_config()
    far = load(write_checkpoint(tmp_path / "far", config={**config, "dspark_target_layer_ids": [1, 2, 4]}))
    with pytest.raises(ValueError, match=r"dspark_target_layer_ids \[1, 2, 4\].*\[5\] outside the target's 4"):
        DSparkDrafter.from_target(far)                                         # capture-after: 4 + 1
    plain = {k: v for k, v in config.items() if not k.startswith("dspark_")}
    # DSpark tensors under a config without DSpark: its MTP layer refuses them by name
    # rather than half-loading them.
    with pytest.raises(ValueError, match=r"mtp\.0\.main_norm\.weight"):
        load(write_checkpoint(tmp_path / "mislabelled", config=plain))
    model = load(write_checkpoint(tmp_path / "plain", tensors={}, config={**plain, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="no DSpark module.*dspark_block_size"):
        DSparkEngineDrafter.for_model(SpeculativeConfig(method="dspark", num_speculative_tokens=2), model)


def _round_independently(x: torch.Tensor, rope: int) -> torch.Tensor:
    # The non-rope channels in blocks of 64 (the last may be shorter), each to E4M3 with the
    # power-of-two scale 2^ceil(log2(amax / 448)); the rope channels untouched.
    nope, out = x[..., :-rope].float(), []
    for block in nope.split(64, dim=-1):
        amax = block.abs().amax(-1, keepdim=True).clamp_min(1e-4)
        scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
        out.append((block / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale)
    return torch.cat([*out, x[..., -rope:].float()], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dim,rope", [(512, 64), (64, 16)], ids=["release", "tiny"])
def test_kv_rounding_of_the_non_rope_part_per_64(dim, rope):
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(3, 7, dim, generator=g) * torch.logspace(-3, 2, 7)[:, None]
    got = round_v4_kv(x, rope)
    assert torch.equal(got, _round_independently(x, rope))
    assert torch.equal(got[..., -rope:], x[..., -rope:]) and not torch.equal(got, x)
    # Per 64, not per 32 (V4.1's MXFP8 grid): one large value sets the scale of its 64.
    y = x.clone()
    y[..., 40] = 1000.0
    assert torch.equal(round_v4_kv(y, rope)[..., :32], _round_independently(y, rope)[..., :32])
    assert not torch.equal(round_v4_kv(y, rope)[..., :32], round_v4_kv(x, rope)[..., :32])


def test_the_drafter_rounds_its_rows_with_an_fp8_kv_target(checkpoint, drafter):
    rounded_target = load(checkpoint, kv_cache_dtype="fp8")
    rounded = DSparkDrafter.from_target(rounded_target)
    assert rounded.round_kv and not drafter.round_kv
    features = torch.randn(6, drafter.cfg.feature_size, generator=torch.Generator().manual_seed(1))
    got = rounded.context_kv(features, torch.arange(6))
    assert torch.equal(got, _round_independently(drafter.context_kv(features, torch.arange(6)), 16))


def _rope_independently(x: torch.Tensor, positions: torch.Tensor, rope: int, theta: float) -> torch.Tensor:
    # Adjacent channel pairs of the last ``rope`` channels as complex numbers, times e^{i p w_k}.
    w = theta ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    turn = torch.polar(torch.ones_like(w), positions[:, None].double() * w)                  # [T, R/2]
    pairs = torch.view_as_complex(x[..., -rope:].double().reshape(*x.shape[:-1], rope // 2, 2).contiguous())
    rotated = torch.view_as_real(pairs * turn[:, None]).flatten(-2)
    return torch.cat([x[..., :-rope].double(), rotated], dim=-1)


@torch.no_grad()
def test_queries_have_a_per_head_rms(drafter, monkeypatch):
    attn = drafter.stages[0].self_attn
    g = torch.Generator().manual_seed(2)
    x, positions = torch.randn(6, 128, generator=g), torch.arange(10, 16)
    seen = []
    original = backend.sparse_attention

    def spy(q, *args, **kwargs):
        seen.append(q)
        return original(q, *args, **kwargs)

    monkeypatch.setattr(backend, "sparse_attention", spy)
    context = torch.randn(2, 5, 64, generator=g)
    attn(x, positions, context, torch.ones(2, 5, dtype=torch.bool), drafter.rope, lambda r: r)
    q = attn.q_b_proj(attn.q_a_norm(attn.q_a_proj(x))).view(6, 4, 64).double()
    q = q / (q.square().mean(-1, keepdim=True) + 1e-6).sqrt()                                # per head, no weight
    want = _rope_independently(q, positions, 16, 10000.0)
    torch.testing.assert_close(seen[0].double(), want, atol=1e-5, rtol=1e-5)
    assert (seen[0][..., :48].square().mean(-1) - 1).abs().max() < 0.5                    # not V4.1's raw q


@torch.no_grad()
def test_the_head_collapses_the_streams_with_hc_head(drafter):
    g = torch.Generator().manual_seed(3)
    cfg = drafter.cfg
    streams = []
    hook = drafter.stages[-1].register_forward_hook(lambda _m, _i, out: streams.append(out[0]))
    context = torch.randn(STAGES, 2, 8, 64, generator=g)
    try:
        hidden, base = drafter.block_states(torch.tensor([5, 9]), torch.tensor([8, 12]), context,
                                            torch.ones(2, 8, dtype=torch.bool))
    finally:
        hook.remove()
    s = streams[0].double()                                                                 # [B*G, n, Hd]
    head = drafter.hc_head
    flat = s.flatten(1)
    mix = (flat / (flat.square().mean(-1, keepdim=True) + cfg.rms_norm_eps).sqrt()) @ head.hc_fn.double().t()
    weights = torch.sigmoid(mix * head.hc_scale.double() + head.hc_base.double()) + cfg.hc_eps      # [B*G, n]
    want = (weights[..., None] * s).sum(1)
    torch.testing.assert_close(hidden.reshape(-1, cfg.hidden_size).double(), want, atol=1e-5, rtol=1e-5)
    # Not V4.1's collapse with a pre-mix that ignores the learned head (the plain stream mean).
    assert (hidden.reshape(-1, cfg.hidden_size).double() - s.mean(1)).abs().max() > 1e-3
    logits = drafter._shared[1](drafter.norm(hidden)).float()
    torch.testing.assert_close(base, logits)


@torch.no_grad()
def test_features_are_the_outputs_of_the_named_layers(target, drafter):
    # dspark_target_layer_ids [1, 2, 3] in capture-after semantics: the 4-stream means of the
    # outputs of layers 1, 2 and 3 (the last layer: the final streams, before the head).
    ids = torch.randint(0, 1000, (13,), generator=torch.Generator().manual_seed(4))
    outputs = {}
    hooks = [layer.register_forward_hook(lambda _m, _i, out, i=i: outputs.__setitem__(i, out))
             for i, layer in enumerate(target.model.layers)]
    try:
        capture = FeatureCapture.new(drafter.cfg.target_layer_ids, torch.arange(13), 128, torch.float32)
        final = target.forward_streams(ids, ForwardContext.no_cache([13], CPU), capture)
    finally:
        for h in hooks:
            h.remove()
    want = torch.cat([outputs[i].mean(1) for i in TARGET_LAYERS], dim=-1)
    assert torch.equal(capture.out, want)
    assert torch.equal(capture.out[:, -128:], final.mean(1))
    # A proposal from those features runs (shapes, finite values).
    context = drafter.context_kv(capture.out, torch.arange(13))
    pos, valid = window_positions(torch.tensor([12]), drafter.cfg.window)
    out = drafter.propose(ids[12:13], torch.tensor([13]), context[:, pos], valid)
    assert out.tokens.shape == (1, BLOCK) and torch.isfinite(out.confidence_logits).all()
