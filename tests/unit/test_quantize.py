"""Weights quantised at load (models/quantize.py, layers/quant_linear.py, FusedMoE.quantize_fp4) on
the CPU, where their forward runs the reference path: round trips within the formats' bounds, the
shipped UE8M0 values given back exactly, the FP8 layer against the reference GEMM, fused projections
of mixed kinds, a whole model's logits and its bytes after load."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from deepinfer import LLM, SamplingParams
from deepinfer.config import QUANTIZATIONS
from deepinfer.kernels import reference
from deepinfer.layers.fused_linear import FusedProjection
from deepinfer.layers.moe import FusedMoE
from deepinfer.layers.quant_linear import Fp8Linear
from deepinfer.models.base import load_module_weights
from deepinfer.models.quant import (FP4_E2M1_VALUES, SCALE_FORMATS, dequant_fp4_e2m1, dequant_fp8_block,
                                    quant_fp4_e2m1, quant_fp8_block, scale_to_float)
from deepinfer.models.quantize import QuantPlan, plan_for, quantize_model, weight_bytes

from ..models.test_deepseek_v4 import HF_STYLE, our_logits, prompts, randomize

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / shape[-1] ** 0.5


@pytest.mark.parametrize("scale_format", SCALE_FORMATS)
@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_fp8_round_trip_within_e4m3_rounding(block, scale_format):
    w = gaussian(200, 256) * torch.logspace(-2, 1, 256)                  # ragged rows, mixed magnitudes
    q, s = quant_fp8_block(w, block, scale_format)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == (torch.float32 if scale_format == "float32" else torch.uint8)
    assert s.shape == (-(-200 // block[0]), 256 // block[1])
    back = dequant_fp8_block(q, s, block)
    per_elem = scale_to_float(s).repeat_interleave(block[0], 0)[:200].repeat_interleave(block[1], 1)
    bound = torch.maximum(w.abs() * 2 ** -4, per_elem * 2 ** -10)       # half an e4m3 ulp
    assert ((back - w).abs() <= bound).all()
    assert (back.abs().amax() <= w.abs().amax())                         # no block overflows 448


@pytest.mark.parametrize("scale_format", SCALE_FORMATS)
def test_fp4_round_trip_gives_the_nearest_e2m1_point(scale_format):
    w = gaussian(3, 40, 128)
    q, s = quant_fp4_e2m1(w, 32, scale_format)
    assert q.dtype == torch.uint8 and q.shape == (3, 40, 64) and s.shape == (3, 40, 4)
    back = dequant_fp4_e2m1(q, s, 32)
    scale = scale_to_float(s).repeat_interleave(32, dim=-1)
    grid = torch.tensor(sorted(set(FP4_E2M1_VALUES)))
    nearest = (w / scale)[..., None].sub(grid).abs().amin(-1) * scale   # distance to the nearest point
    torch.testing.assert_close((back - w).abs(), nearest, rtol=0, atol=1e-7)
    assert 0.05 < ((back - w).norm() / w.norm()).item() < 0.15


def test_ue8m0_values_requantised_from_16_bits_are_the_shipped_ones():
    """What the loader does with a shipped checkpoint (dequantise, round to bf16, quantise again
    with the same format) gives back the shipped values exactly, for FP8 and FP4."""
    w = gaussian(96, 128, seed=3) * 7
    q, s = quant_fp8_block(w, (32, 32), "ue8m0")
    shipped = dequant_fp8_block(q, s, (32, 32))
    again = dequant_fp8_block(*quant_fp8_block(shipped.bfloat16(), (32, 32), "ue8m0"), (32, 32))
    assert torch.equal(again, shipped)
    q4, s4 = quant_fp4_e2m1(w, 32, "ue8m0")
    shipped4 = dequant_fp4_e2m1(q4, s4)
    assert torch.equal(dequant_fp4_e2m1(*quant_fp4_e2m1(shipped4.bfloat16(), 32, "ue8m0")), shipped4)


@pytest.mark.parametrize("block,scale_format", [((128, 128), "float32"), ((32, 32), "ue8m0")])
def test_fp8_linear_forward_is_the_reference_fp8_gemm(block, scale_format):
    lin = nn.Linear(256, 160, bias=False)
    with torch.no_grad():
        lin.weight.copy_(gaussian(160, 256, seed=1))
    fp8 = Fp8Linear.from_linear(lin, block, scale_format)
    assert not fp8.weight.requires_grad and fp8.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(2))
    out = fp8(x)
    ref = reference.fp8_linear(x, fp8.weight, fp8.scale, block, 128, scale_format == "ue8m0")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    exact = lin(x)
    assert ((out - exact).norm() / exact.norm()).item() < 0.05            # e4m3 weights and activations


def test_fp8_linear_refuses_widths_the_gemm_cannot_take():
    with pytest.raises(ValueError, match="in_features=48"):
        Fp8Linear(48, 64, (32, 32))
    with pytest.raises(ValueError, match="scale_format='e4m3'"):
        Fp8Linear(64, 64, (32, 32), "e4m3")


def test_fused_projection_of_mixed_kinds_equals_its_pieces():
    torch.manual_seed(0)
    pieces = [nn.Linear(128, n, bias=False) for n in (64, 32, 96, 16)]
    fused = FusedProjection(pieces)
    for i in (0, 2):
        new = Fp8Linear.from_linear(pieces[i], (32, 32), "ue8m0")
        fused.replace(pieces[i], new)
        pieces[i] = new
    x = torch.randn(7, 128)
    unfused = [p(x) for p in pieces]
    fused.fuse()
    assert fused.fused and fused.weight is None                         # two kinds: two GEMMs
    for got, want in zip(fused(x), unfused):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The FP8 pieces' parameters are views of the one stacked FP8 weight.
    assert pieces[0].weight.untyped_storage().data_ptr() == pieces[2].weight.untyped_storage().data_ptr()


def test_fp4_experts_forward_is_the_reference():
    moe = FusedMoE(4, 64, 32)
    with torch.no_grad():
        moe.gate_up_proj.copy_(gaussian(4, 64, 64, seed=4))
        moe.down_proj.copy_(gaussian(4, 64, 32, seed=5))
    gate_up, down = moe.gate_up_proj.detach().clone(), moe.down_proj.detach().clone()
    moe.quantize_fp4("float32")
    assert moe.fp4 and moe.gate_up_proj.dtype == torch.uint8 and moe.down_proj.shape == (4, 64, 16)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(6))
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(7))
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
    out = moe(x, weights, ids)
    ref = reference.fp4_moe_experts(x, moe.gate_up_proj, moe.gate_up_proj_scale, moe.down_proj,
                                    moe.down_proj_scale, weights, ids, 0.0)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    exact = reference.clamped_moe_experts(x, gate_up, down, weights, ids, 0.0)
    assert ((out - exact).norm() / exact.norm()).item() < 0.3
    # The FP4 layer takes shipped codes into the same rows, and refuses 16-bit values for them.
    assert moe.expert_weight_index("up_proj", 1) == ("gate_up_proj", (1, slice(32, 64)))
    with pytest.raises(ValueError, match="'w' has dtype torch.float32, but gate_up_proj keeps quantised"):
        load_module_weights(moe, [("w", gate_up[:, :, :32])], lambda _: "gate_up_proj")


def test_fp4_experts_note_whether_their_scales_allow_the_bf16_decode():
    """FusedMoE.note_fp4_scales (run by CausalLM.after_load): UE8M0 scales of at most 2^1 let the
    FP4 kernel decode codes straight to bf16; a larger one, float32 scales or 16-bit weights not."""
    moe = FusedMoE(4, 64, 32)
    with torch.no_grad():
        moe.gate_up_proj.copy_(gaussian(4, 64, 64, seed=4))
        moe.down_proj.copy_(gaussian(4, 64, 32, seed=5))
    moe.note_fp4_scales()
    assert not moe.fp4_small_scales                                   # 16-bit experts
    moe.quantize_fp4("ue8m0")
    moe.note_fp4_scales()
    assert moe.fp4_small_scales
    with torch.no_grad():
        moe.down_proj_scale[3, 5, 0] = 129                            # a scale of 2^2
    moe.note_fp4_scales()
    assert not moe.fp4_small_scales
    f32 = FusedMoE(4, 64, 32)
    f32.quantize_fp4("float32")
    f32.note_fp4_scales()
    assert not f32.fp4_small_scales


def test_plan_for_each_quantization():
    shipped = {"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
                                       "expert_dtype": "fp4"}}
    assert plan_for(shipped, "auto", CPU) is None                         # the CPU dequantises
    assert plan_for(shipped, "auto", CUDA) == QuantPlan(True, True, (32, 32), "ue8m0", "ue8m0")
    assert plan_for({}, "auto", CUDA) is None and plan_for(shipped, "none", CUDA) is None
    assert plan_for({}, "fp8", CPU) == QuantPlan(True, False, (128, 128), "float32", "ue8m0")
    assert plan_for({}, "mxfp4-experts", CPU).label == "fp4-experts"
    assert plan_for({}, "fp8+mxfp4-experts", CPU).label == "fp8+fp4-experts"
    with pytest.raises(ValueError, match="quantization='int4' is not supported"):
        plan_for({}, "int4", CPU)
    assert set(QUANTIZATIONS) == {"auto", "none", "fp8", "mxfp4-experts", "fp8+mxfp4-experts"}


def test_quantised_deepseek_v4_logits_and_bytes():
    """A random DeepSeek-V4 quantised at load as V4.1 ships (32x32 UE8M0 FP8, MXFP4 experts): its
    logits stay close to the 16-bit model's, after_load fuses the FP8 projections, and the bytes in
    memory are those of the formats."""
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    base = DeepseekV4ForCausalLM(HF_STYLE, torch.float32).eval()
    randomize(base, 5, HF_STYLE["n_routed_experts"], HF_STYLE["num_experts_per_tok"])
    quant = copy.deepcopy(base)
    counts = quantize_model(quant, QuantPlan(True, True, (32, 32), "ue8m0", "ue8m0"))
    base.after_load()
    quant.after_load()
    fp8 = [(n, m) for n, m in quant.named_modules() if isinstance(m, Fp8Linear)]
    names = {n.split(".")[-1] for n, _ in fp8}
    # Hidden 64: q_a, kv and the shared experts go FP8; q_b and o_b read 24 inputs, too few for the GEMM.
    assert counts["fp8_linears"] == len(fp8) > 0 and names <= {"q_a_proj", "kv_proj", "o_b_proj", "gate_proj",
                                                                 "up_proj", "down_proj"}
    assert not any("compressor" in n or "lm_head" in n for n, _ in fp8)
    assert counts["fp4_expert_layers"] == HF_STYLE["num_hidden_layers"] + HF_STYLE["num_nextn_predict_layers"]
    seqs = prompts([5, 9], HF_STYLE["vocab_size"])
    with torch.no_grad():
        ref, got = our_logits(base, seqs), our_logits(quant, seqs)
    for r, g in zip(ref, got):
        # Random weights through 5 layers of FP4 experts (about 0.2 each) and FP8 projections.
        assert 0.01 < ((g - r).norm() / r.norm()).item() < 0.6
    nbytes = weight_bytes(quant)
    expected_fp8 = sum(m.weight.numel() + m.scale.numel() for _, m in fp8)       # 1 byte each
    assert nbytes["fp8"] == expected_fp8
    experts = [m for m in quant.modules() if isinstance(m, FusedMoE)]
    assert nbytes["fp4"] == sum(m.gate_up_proj.numel() * 17 // 16 + m.down_proj.numel() * 17 // 16 for m in experts)
    assert nbytes["total"] < weight_bytes(base)["total"]


def test_llm_quantized_at_load_on_the_cpu_generates():
    llm = LLM(device="cpu", quantization="fp8+mxfp4-experts", enforce_eager=True, max_model_len=64)
    model = llm.engine.model
    assert model.weight_bytes["fp8"] > 0 and model.weight_bytes["fp4"] > 0
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="quantization='awq' is not supported"):
        LLM(device="cpu", quantization="awq")


@pytest.mark.parametrize("quantization", ["fp8", "mxfp4-experts"])
def test_quantised_model_computes_with_its_dequantised_weights(quantization):
    """The quantised model equals the 16-bit model holding the dequantised weights: exactly for FP4
    experts (the reference dequantises, then runs the same experts), and up to the activations'
    e4m3 rounding for FP8 projections."""
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
    base = DeepseekV4ForCausalLM(HF_STYLE, torch.float32).eval()
    randomize(base, 6, HF_STYLE["n_routed_experts"], HF_STYLE["num_experts_per_tok"])
    quant = copy.deepcopy(base)
    plan = plan_for({"quantization_config": {"weight_block_size": [32, 32], "scale_fmt": "ue8m0"}},
                    quantization, CPU)
    quantize_model(quant, plan)
    deq = copy.deepcopy(base)
    with torch.no_grad():
        for (name, m), (_, d) in zip(quant.named_modules(), deq.named_modules()):
            if isinstance(m, Fp8Linear):
                d.weight.copy_(m.dequantized())
            elif isinstance(m, FusedMoE) and m.fp4:
                d.gate_up_proj.copy_(dequant_fp4_e2m1(m.gate_up_proj, m.gate_up_proj_scale))
                d.down_proj.copy_(dequant_fp4_e2m1(m.down_proj, m.down_proj_scale))
    seqs = prompts([6, 3], HF_STYLE["vocab_size"], seed=2)
    with torch.no_grad():
        want, got = our_logits(deq, seqs), our_logits(quant, seqs)
    for w, g in zip(want, got):
        err = ((g - w).norm() / w.norm()).item()
        assert err < (1e-5 if quantization == "mxfp4-experts" else 0.1), err


V41_CHECKPOINT = Path(__file__).resolve().parent.parent / "data" / "v41_reference" / "checkpoint"


def test_shipped_checkpoint_kept_in_its_formats_gives_its_values_and_bytes():
    """The tiny DeepSeek-V4.1 release-format checkpoint (32 x 32 UE8M0 FP8, MXFP4 experts) loaded with
    its formats kept: every FP8 layer and FP4 expert holds exactly the values the 16-bit load
    dequantises, in the shapes (so the bytes) the checkpoint ships them in."""
    from deepinfer.config import ModelConfig
    from deepinfer.models.loader import load_model, quantised_checkpoint_bytes

    def load(quantization: str):
        cfg = ModelConfig.from_path(V41_CHECKPOINT, "float32", None, CPU, quantization=quantization)
        return load_model(cfg, CPU)

    plain, kept = load("none"), load("fp8+mxfp4-experts")
    plain_modules = dict(plain.named_modules())
    shipped = _safetensors_shapes(V41_CHECKPOINT / "model.safetensors")
    fp8 = [(n, m) for n, m in kept.named_modules() if isinstance(m, Fp8Linear)]
    assert {n.split(".")[-1] for n, _ in fp8} >= {"q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"}
    for name, m in fp8:
        assert torch.equal(m.dequantized(), plain_modules[name].weight.float()), name
        assert m.scale.dtype == torch.uint8 and m.block == (32, 32)
    experts = [(n, m) for n, m in kept.named_modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.fp4 for _, m in experts)
    for name, m in experts:
        ref = plain_modules[name]
        assert torch.equal(dequant_fp4_e2m1(m.gate_up_proj, m.gate_up_proj_scale), ref.gate_up_proj)
        assert torch.equal(dequant_fp4_e2m1(m.down_proj, m.down_proj_scale), ref.down_proj)
    # Bytes: the shipped per-expert w1/w3/w2 codes and scales of the layers, and the FP8 layers' shapes.
    layer_experts = [k for k in shipped if k.startswith("layers.") and ".ffn.experts." in k]
    assert kept.weight_bytes["fp4"] == sum(torch.Size(shipped[k]).numel() for k in layer_experts)
    wq_a = shipped["layers.0.attn.wq_a.weight"], shipped["layers.0.attn.wq_a.scale"]
    q_a = dict(fp8)["model.layers.0.self_attn.q_a_proj"]
    assert [list(q_a.weight.shape), list(q_a.scale.shape)] == [list(s) for s in wq_a]
    assert kept.weight_bytes["total"] < plain.weight_bytes["total"]
    # Shipped FP8 that stays 16-bit here (o_a, engram, MTP) keeps the checkpoint's figure above ours.
    assert kept.weight_bytes["fp8"] + kept.weight_bytes["fp4"] < quantised_checkpoint_bytes(str(V41_CHECKPOINT))


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def test_quantised_deepseek_v3_keeps_absorbed_mla_weights_16_bit():
    """DeepSeek-V3: its projections go FP8 except kv_b_proj (absorbed MLA decode reads the weight);
    the quantised model's logits stay close to the 16-bit model's."""
    from deepinfer.forward_context import ForwardContext
    from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
    from deepinfer.models.dummy import init_dummy_weights
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=100, hidden_size=128, intermediate_size=256,
               moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
               n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
               max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
               routed_scaling_factor=1.0, norm_topk_prob=True)
    base = DeepseekV3ForCausalLM(cfg, torch.float32).eval()
    init_dummy_weights(base, 0)
    quant = copy.deepcopy(base)
    quantize_model(quant, plan_for(cfg, "fp8", CPU))
    fp8 = {n for n, m in quant.named_modules() if isinstance(m, Fp8Linear)}
    assert any(n.endswith("self_attn.o_proj") for n in fp8) and any(n.endswith("mlp.gate_proj") for n in fp8)
    assert not any(n.endswith("kv_b_proj") or n.endswith("lm_head") for n in fp8)
    ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = (m.compute_logits(m(ids, ForwardContext.no_cache([12], CPU))) for m in (base, quant))
    # About 0.03 per FP8 projection; a top-k routing choice flipped by the rounding adds more.
    assert 0.0 < ((got - want).norm() / want.norm()).item() < 0.25


@pytest.mark.parametrize("block,scale_format", [((128, 128), "float32"), ((32, 32), "ue8m0")])
def test_grouped_linear_quantises_to_a_grouped_fp8_linear(block, scale_format):
    """V4's grouped o_a: a GroupedLinear becomes Fp8Linear(groups=g) holding the stacked [N, K]
    weight as the checkpoint ships it, and computes each group's block of the product, as the
    16-bit layer on its dequantised weight does (up to the activations' e4m3 rounding). A
    tensor-parallel shard of one stays 16-bit."""
    from deepinfer.layers.deepseek_v4_attention import GroupedLinear
    from deepinfer.models import quantize
    groups, k, npg = 4, 256, 32
    layer = GroupedLinear(k, groups * npg, groups)
    with torch.no_grad():
        layer.weight.copy_(gaussian(groups * npg, k, seed=5) / k ** 0.5)
    fp8 = Fp8Linear.from_linear(layer, block, scale_format)
    assert fp8.groups == groups and fp8.weight.shape == (groups * npg, k) and "groups=4" in repr(fp8)
    x = gaussian(3, groups, k, seed=6)
    with torch.no_grad():
        layer.weight.copy_(fp8.dequantized())
        want = layer(x)
    got = fp8(x)
    assert got.shape == want.shape == (3, groups, npg)
    assert ((got - want).norm() / want.norm()).item() < 0.05
    assert quantize._plain_linear(layer)
    layer.weight.tp_shard = (0, 0, 2)
    assert not quantize._plain_linear(layer)
    with pytest.raises(ValueError, match="groups=3"):
        Fp8Linear(k, groups * npg, block, scale_format, groups=3)
