"""Checkpoints in DeepSeek's release formats loaded straight into the quantised layers
(models/quantize.py ``keep_shipped``), on the CPU: the layers hold the shipped codes and scales
byte for byte, never had 16-bit weights, and compute what the dequantise-then-requantise path
(the one before, still taken by every other layer) gives. Two checkpoints: the tiny DeepSeek-V4.1
reference (32 x 32 UE8M0 FP8, MXFP4 experts) and the tiny DeepSeek-V4 fixture written here in
V4's formats (128 x 128 float32-scaled FP8, FP4 experts with float32 scales per 32)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.config import ModelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.layers.moe import FusedMoE
from deepinfer.layers.quant_linear import Fp8Linear
from deepinfer.models.base import ParamSlice
from deepinfer.models.loader import _default_dtype, iter_weights, load_model
from deepinfer.models.quant import dequant_fp4_e2m1, dequant_fp8_block, quant_fp4_e2m1, quant_fp8_block
from deepinfer.models.quantize import plan_for, quantize_model
from deepinfer.models.registry import get_model_class

CPU = torch.device("cpu")
DATA = Path(__file__).resolve().parent.parent / "data"
V41_CHECKPOINT = DATA / "v41_reference" / "checkpoint"
# The FP8 projections the tiny V4.1 release checkpoint ships, the 8 grouped o_a ones included (its
# 7 layers and the DSpark module's).
V41_FP8_LINEARS = 67
QUANTIZATION = "fp8+mxfp4-experts"

# What DeepSeek-V4 ships in FP8 (the attention's projections, the indexer's query, the shared
# expert) and in FP4 (the routed experts), under the names transformers saves.
_V4_FP8 = re.compile(r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                     r"|ffn\.shared_experts\.w[123])\.weight$")
_V4_FP4 = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def write_v4_release(out: Path) -> Path:
    """The tiny DeepSeek-V4 fixture (float32) in V4's release formats: FP8 e4m3 with one float32
    scale per 128 x 128 block, packed FP4 experts (uint8) with one float32 scale per 32 inputs."""
    src = DATA / "tiny-v4-model"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if _V4_FP8.search(name):
            tensors[name], tensors[name[:-len("weight")] + "scale"] = quant_fp8_block(w, (128, 128), "float32")
        elif _V4_FP4.search(name):
            tensors[name], tensors[name[:-len("weight")] + "scale"] = quant_fp4_e2m1(w, 32, "float32")
        else:
            tensors[name] = w
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def v4_release(tmp_path_factory) -> Path:
    return write_v4_release(tmp_path_factory.mktemp("v4") / "release")


def load_direct(path: Path, dtype: str):
    return load_model(ModelConfig.from_path(path, dtype, None, CPU, quantization=QUANTIZATION), CPU)


@torch.no_grad()
def load_requantised(path: Path, dtype: str, device: torch.device = CPU):
    """The path every layer took before: the whole model built in ``dtype`` on ``device``, every
    shipped FP8/FP4 tensor dequantised into it, then quantised again in the plan's formats."""
    cfg = ModelConfig.from_path(path, dtype, None, device, quantization=QUANTIZATION)
    with torch.device(device), _default_dtype(cfg.dtype):
        model = get_model_class(cfg.architecture)(cfg.hf_config, cfg.dtype)
    model.load_assets(cfg.path)
    model.load_weights(iter_weights(cfg.path, cfg.hf_config, model.keeps_quantized, model.skips_tensor))
    quantize_model(model, plan_for(cfg.hf_config, QUANTIZATION, device))
    model.after_load()
    return model.eval()


def shipped_parts(model, checkpoint: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor, torch.Tensor,
                                                                            torch.Tensor, torch.Tensor]]:
    """(checkpoint weight name, the model's codes and scales it went into, the shipped codes and
    scales) for every tensor the model loaded as shipped."""
    out = []
    for name in sorted(model.shipped_tensors):
        if not name.endswith(".weight"):
            continue
        scale_name = name[:-len("weight")] + "scale"
        assert scale_name in model.shipped_tensors
        dest = model.remap_weight_name(name)
        if isinstance(dest, ParamSlice):
            module_name, _, param = dest.name.rpartition(".")
            module = model.get_submodule(module_name)
            codes, scales = getattr(module, param)[dest.index], getattr(module, param + "_scale")[dest.index]
        else:
            module = model.get_submodule(dest.rpartition(".")[0])
            codes, scales = module.weight, module.scale
        out.append((name, codes, scales, checkpoint[name], checkpoint[scale_name]))
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, a 1-byte dtype as its bytes."""
    t = t.detach().cpu().contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_holds_the_shipped_bytes(model, path: Path) -> int:
    """Every tensor the model loaded as shipped sits in its layer byte for byte; returns how many
    weights (with their scales) it loaded so."""
    parts = shipped_parts(model, load_file(path / "model.safetensors"))
    for name, codes, scales, shipped_codes, shipped_scales in parts:
        assert torch.equal(as_bytes(codes), as_bytes(shipped_codes)), name
        assert torch.equal(as_bytes(scales), as_bytes(shipped_scales)), name
    assert not any(p.is_meta for p in model.parameters())
    return len(parts)


def quantised_layers(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear) or (isinstance(m, FusedMoE) and m.fp4)}


def dequantised(layer: torch.nn.Module) -> list[torch.Tensor]:
    if isinstance(layer, Fp8Linear):
        return [layer.dequantized()]
    return [dequant_fp4_e2m1(layer.gate_up_proj, layer.gate_up_proj_scale),
            dequant_fp4_e2m1(layer.down_proj, layer.down_proj_scale)]


@torch.no_grad()
def logprobs_and_greedy(model, vocab: int, steps: int = 4,
                        device: torch.device = CPU) -> tuple[torch.Tensor, list[list[int]]]:
    """Log-probabilities of two random prompts (one forward), and each prompt's greedy
    continuation by repeated full forwards, with the model on ``device``."""
    seqs = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 12)]
    ctx = ForwardContext.no_cache([len(s) for s in seqs], device)
    logprobs = model.compute_logits(model(torch.cat(seqs).to(device), ctx)).log_softmax(-1)
    greedy = []
    for s in seqs:
        ids = s.tolist()
        for _ in range(steps):
            logits = model.compute_logits(model(torch.tensor(ids, device=device),
                                                ForwardContext.no_cache([len(ids)], device)))
            ids.append(int(logits[-1].argmax()))
        greedy.append(ids[len(s):])
    return logprobs, greedy


def test_v41_layers_hold_the_shipped_bytes_and_compute_as_the_requantised_ones():
    """V4.1 (UE8M0): every FP8 projection and expert stack loads as shipped. The old path gives the
    same values (its scales can only come out smaller, its codes scaled up exactly), but other
    bytes for some blocks; the two models' log-probabilities and greedy tokens are identical."""
    direct, old = load_direct(V41_CHECKPOINT, "float32"), load_requantised(V41_CHECKPOINT, "float32")
    layers, old_layers = quantised_layers(direct), quantised_layers(old)
    assert layers.keys() == old_layers.keys()
    n_fp8 = sum(isinstance(m, Fp8Linear) for m in layers.values())
    n_experts = sum(m.gate_up_proj.shape[0] for m in layers.values() if isinstance(m, FusedMoE))
    assert n_fp8 == V41_FP8_LINEARS and n_experts == 8 * 8
    assert assert_holds_the_shipped_bytes(direct, V41_CHECKPOINT) == n_fp8 + 3 * n_experts
    bytes_differ = 0
    for name, layer in layers.items():
        for got, want in zip(dequantised(layer), dequantised(old_layers[name])):
            assert torch.equal(got, want), name
        if isinstance(layer, Fp8Linear):
            bytes_differ += int((as_bytes(layer.weight) != as_bytes(old_layers[name].weight)).sum())
            assert (old_layers[name].scale <= layer.scale).all(), name
    assert bytes_differ > 0               # the old path's codes are not the shipped ones
    # The MTP drafter's tensors are not loaded here: they still arrive dequantised.
    assert direct.drafter_tensors["mtp.0.attn.wq_a.weight"].dtype == torch.float32
    (lp_direct, greedy_direct), (lp_old, greedy_old) = (logprobs_and_greedy(m, 320) for m in (direct, old))
    assert torch.equal(lp_direct, lp_old) and greedy_direct == greedy_old


def test_v4_float32_scales_load_as_shipped(v4_release):
    """V4 (float32 scales, 128 x 128 blocks): the FP8 projections whose input width takes 128-blocks
    (q_a, kv, the grouped o_a, the shared expert's gate and up) and every expert stack load as
    shipped, whatever the compute dtype. The old path in float32 gives the same bytes; in bf16 the dequantised values
    are rounded to bf16 before requantising, so its scales move by up to one bf16 rounding
    (2^-8 relative; the codes stay) and its log-probabilities differ a little."""
    direct = {dtype: load_direct(v4_release, dtype) for dtype in ("float32", "bfloat16")}
    for model in direct.values():
        kinds = {n.rsplit(".", 1)[-1] for n, m in quantised_layers(model).items() if isinstance(m, Fp8Linear)}
        assert kinds == {"q_a_proj", "kv_proj", "o_a_proj", "gate_proj", "up_proj"}
        assert assert_holds_the_shipped_bytes(model, v4_release) == 20 + 4 * 8 * 3
    # Shipped FP8 that cannot stay FP8 here (q_b, o_b read 64 inputs) arrives dequantised.
    assert direct["bfloat16"].get_submodule("model.layers.0.self_attn.q_b_proj").weight.dtype == torch.bfloat16
    old32, old16 = load_requantised(v4_release, "float32"), load_requantised(v4_release, "bfloat16")
    layers = quantised_layers(direct["bfloat16"])
    for name, layer in layers.items():
        for a, b in zip(layer.state_dict().values(), quantised_layers(old32)[name].state_dict().values()):
            assert torch.equal(as_bytes(a), as_bytes(b)), name
        for (kind, a), b in zip(layer.state_dict().items(), quantised_layers(old16)[name].state_dict().values()):
            if a.dtype == torch.float32:                                    # scales
                assert ((a - b).abs() <= a.abs() * 2 ** -8).all(), (name, kind)
            else:
                assert torch.equal(a, b), (name, kind)
    lp_direct, greedy_direct = logprobs_and_greedy(direct["bfloat16"], 1000)
    lp_old, greedy_old = logprobs_and_greedy(old16, 1000)
    assert 0 < (lp_direct - lp_old).abs().max().item() < 0.3 and greedy_direct == greedy_old
    lp32, greedy32 = logprobs_and_greedy(direct["float32"], 1000)
    assert torch.equal(lp32, logprobs_and_greedy(old32, 1000)[0]) and greedy32 == logprobs_and_greedy(old32, 1000)[1]


def test_a_layer_shipped_in_another_format_takes_the_old_path(tmp_path):
    """One FP8 layer whose scale is stored as float32 (a UE8M0 plan) and the experts under a plan
    without FP4 experts: those layers load dequantised (and the FP8 one is quantised after
    loading, to the same values); the rest still load as shipped."""
    path = tmp_path / "v41"
    shutil.copytree(V41_CHECKPOINT, path)
    tensors = load_file(path / "model.safetensors")
    odd = "layers.0.attn.wq_a"
    tensors[odd + ".scale"] = tensors[odd + ".scale"].float()
    save_file(tensors, path / "model.safetensors")
    model = load_model(ModelConfig.from_path(path, "float32", None, CPU, quantization="fp8"), CPU)
    assert odd + ".weight" not in model.shipped_tensors and "layers.0.attn.wkv.weight" in model.shipped_tensors
    assert not any(".experts." in n for n in model.shipped_tensors)
    q_a = model.get_submodule("model.layers.0.self_attn.q_a_proj")
    assert isinstance(q_a, Fp8Linear) and q_a.scale.dtype == torch.uint8
    reference = load_model(ModelConfig.from_path(V41_CHECKPOINT, "float32", None, CPU, quantization="none"), CPU)
    assert torch.equal(q_a.dequantized(), reference.get_submodule("model.layers.0.self_attn.q_a_proj").weight)
    experts = model.get_submodule("model.layers.0.mlp.experts")
    want = reference.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    assert not experts.fp4 and torch.equal(experts.gate_up_proj, want)
    assert assert_holds_the_shipped_bytes(model, path) == V41_FP8_LINEARS - 1


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_loads_its_experts_as_shipped(rank):
    """Under an expert-parallel group of 2 each rank's stacks hold its four experts' shipped bytes
    (loading makes no collective call, so no process group is started)."""
    from deepinfer.parallel.groups import Group, ParallelGroups, use_groups
    with use_groups(ParallelGroups(ep=Group(2, rank, object()))):
        model = load_direct(V41_CHECKPOINT, "float32")
    stacks = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert all(m.fp4 and m.ep.local_experts() == list(range(4 * rank, 4 * rank + 4)) for m in stacks)
    assert assert_holds_the_shipped_bytes(model, V41_CHECKPOINT) == V41_FP8_LINEARS + len(stacks) * 4 * 3
    assert all(f".experts.{e}." not in n for n in model.shipped_tensors for e in range(4 * (1 - rank), 4 * (2 - rank)))


def test_tensor_parallel_shards_stay_16_bit():
    """At tp = 2 the sharded projections (q_b, o_a, o_b) load dequantised, their rank's part of the
    16-bit weights; the unsharded FP8 ones and the experts load as shipped."""
    from deepinfer.parallel.groups import Group, ParallelGroups, use_groups
    from deepinfer.parallel.tensor import ColumnParallelLinear
    with use_groups(ParallelGroups(tp=Group(2, 1, object()))):
        model = load_direct(V41_CHECKPOINT, "float32")
    q_b = model.get_submodule("model.layers.0.self_attn.q_b_proj")
    assert isinstance(q_b, ColumnParallelLinear) and q_b.weight.dtype == torch.float32
    full = load_model(ModelConfig.from_path(V41_CHECKPOINT, "float32", None, CPU, quantization="none"), CPU)
    rows = q_b.weight.shape[0]
    assert torch.equal(q_b.weight, full.get_submodule("model.layers.0.self_attn.q_b_proj").weight[rows:])
    assert "layers.0.attn.wq_b.weight" not in model.shipped_tensors
    assert assert_holds_the_shipped_bytes(model, V41_CHECKPOINT) > 8 * 8 * 3


@pytest.mark.slow
def test_load_peak_drops_to_the_shipped_size(tmp_path):
    """scripts/probes/load_peak.py on the CPU (128 experts of width 256 per layer, bf16 compute):
    the peak resident memory a direct load adds stays near twice the checkpoint (its pages mapped
    from the file plus the layers' copies), while the path before builds the 16-bit experts
    (64/17 times their FP4 bytes) first. Measured: 60 MB against 179 MB for a
    29 MB checkpoint."""
    probe = Path(__file__).resolve().parents[2] / "scripts" / "probes" / "load_peak.py"
    subprocess.run([sys.executable, str(probe), "--device", "cpu", "--experts", "128", "--intermediate", "256",
                    "--out", str(tmp_path)], check=True, capture_output=True)
    report = json.loads((tmp_path / "load_peak.json").read_text())
    direct, old = report["runs"]
    assert direct["mode"] == "direct" and old["mode"] == "requantised"
    assert direct["weight_bytes"] == old["weight_bytes"] and direct["shipped_tensors"] > 0
    # FP4 holds n/2 code bytes and n/32 scale bytes for n values; bf16 holds 2n bytes.
    sixteen_bit_experts = 2 * direct["weight_bytes"]["fp4"] * 32 // 17
    assert direct["peak_bytes"] < 2.5 * report["checkpoint_bytes"]
    assert old["peak_bytes"] > direct["peak_bytes"] + 0.8 * sixteen_bit_experts


def test_deepseek_v3_names_with_weight_scale_inv_load_as_shipped(tmp_path):
    """DeepSeek-V3's HF layout (``X.weight_scale_inv``, float32 128 x 128 scales): its FP8 projections
    load as shipped, the scale into ``Fp8Linear.scale``; kv_b_proj (which the plan keeps 16-bit)
    arrives dequantised."""
    from deepinfer.models.deepseek_v3 import DeepseekV3ForCausalLM
    from deepinfer.models.dummy import init_dummy_weights
    cfg = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=100, hidden_size=128, intermediate_size=256,
               moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
               q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
               n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
               max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
               routed_scaling_factor=1.0, norm_topk_prob=True,
               quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    model = DeepseekV3ForCausalLM(cfg, torch.float32)
    init_dummy_weights(model, 0)
    tensors = {}
    for name, w in model.state_dict().items():
        if name.startswith("mtp."):
            continue
        if name.endswith(("proj.weight", "proj_with_mqa.weight")) and w.dim() == 2:
            tensors[name], tensors[name[:-len("weight")] + "weight_scale_inv"] = quant_fp8_block(w, (128, 128))
        else:
            tensors[name] = w.contiguous()
    tmp_path.joinpath("config.json").write_text(json.dumps(cfg))
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = load_model(ModelConfig.from_path(tmp_path, "float32", None, CPU, quantization="fp8"), CPU)
    fp8 = {n for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)}
    assert "model.layers.0.self_attn.o_proj" in fp8 and "model.layers.0.mlp.gate_proj" in fp8
    assert {f"{n}.weight_scale_inv" for n in fp8} <= loaded.shipped_tensors
    for name in fp8:
        layer = loaded.get_submodule(name)
        assert torch.equal(as_bytes(layer.weight), as_bytes(tensors[name + ".weight"]))
        assert torch.equal(layer.scale, tensors[name + ".weight_scale_inv"])
    kv_b = loaded.get_submodule("model.layers.0.self_attn.kv_b_proj").weight
    shipped = [tensors[f"model.layers.0.self_attn.kv_b_proj.{part}"] for part in ("weight", "weight_scale_inv")]
    assert kv_b.dtype == torch.float32 and torch.equal(kv_b, dequant_fp8_block(*shipped, 128))
