"""bench/floors.py: the byte and FLOP accounting against built models (tiny, and
DeepSeek-V4-Flash widths on the meta device), hand-counted KV bytes and FLOPs, and
the measured-rate probes."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.bench.floors import (DeepseekV4Cost, expected_distinct_experts, floor_ms, measure_hbm_bandwidth,
                                    measure_matmul_tflops, parts_floor_ms)
from deepinfer.bench.model_shapes import resolve_config
from deepinfer.models.deepseek_v4 import DeepseekV4Args, DeepseekV4ForCausalLM

SL, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# One layer of each type, the first hash-routed: window 8, CSA ratio 4 with top-3, HCA ratio 8.
TINY = dict(
    architectures=["DeepseekV4ForCausalLM"], vocab_size=96, hidden_size=64, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=24,
    partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=6,
    layer_types=[SL, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={CSA: 4, HCA: 8}, sliding_window=8, o_groups=2, o_lora_rank=12, index_n_heads=8,
    index_head_dim=16, index_topk=3, max_position_embeddings=256, num_nextn_predict_layers=0)


def build(config: dict, dtype: torch.dtype, device: str = "cpu") -> DeepseekV4ForCausalLM:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return DeepseekV4ForCausalLM(config, dtype)
    finally:
        torch.set_default_dtype(previous)


def tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def is_routed(name: str) -> bool:
    return ".mlp.experts." in name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameter_table_matches_built_model(dtype):
    model = build(TINY, dtype)
    sd = tensors(model)
    elem = torch.empty((), dtype=dtype).element_size()
    cost = DeepseekV4Cost(DeepseekV4Args.from_hf(TINY), elem, elem)
    assert cost.num_params == sum(t.numel() for t in sd.values())
    assert cost.param_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    # Read whole every step: all but the embedding table, routed experts and the hash table.
    dense = sum(t.numel() * t.element_size() for n, t in sd.items()
                if not is_routed(n) and n != "model.embed_tokens.weight" and not n.endswith("tid2eid"))
    assert cost.dense_bytes() == dense
    expert = (sd["model.layers.1.mlp.experts.gate_up_proj"][0].numel()
              + sd["model.layers.1.mlp.experts.down_proj"][0].numel())
    assert cost.expert_bytes == expert * elem
    # Matmul parameters per token: every 2-D weight a token multiplies (no position biases,
    # embeddings or lm_head), the hyper-connection mixers, and K experts per layer.
    matmul = sum(t.numel() for n, t in sd.items()
                 if (t.dim() == 2 and n.endswith("weight") or n.endswith((".fn", "hc_fn")))
                 and not n.startswith(("model.embed_tokens", "lm_head")))
    layers, top_k = 3, 2
    assert cost.matmul_params_per_token() == matmul + layers * top_k * expert


def test_tied_embeddings_count_once_and_lm_head_still_read():
    cfg = {**TINY, "tie_word_embeddings": True}
    sd = tensors(build(cfg, torch.float32))
    cost = DeepseekV4Cost(DeepseekV4Args.from_hf(cfg), 4, 4, tie_word_embeddings=True)
    unique = {id(t): t for t in build(cfg, torch.float32).state_dict(keep_vars=True).values()}
    assert cost.num_params == sum(t.numel() for t in unique.values()) < sum(t.numel() for t in sd.values())
    untied = DeepseekV4Cost(DeepseekV4Args.from_hf(TINY), 4, 4)
    assert cost.dense_bytes() == untied.dense_bytes()     # the head matrix is read either way


def test_kv_bytes_and_attention_flops_by_hand():
    cost = DeepseekV4Cost(DeepseekV4Args.from_hf(TINY), 2, 2)
    # s = 40 tokens of context: SL reads its window of 8; CSA the window, min(3, 10) selected entries
    # and 10 indexer keys of 16; HCA the window and 40 // 8 = 5 entries. D = 32, 2 bytes.
    assert cost.kv_read_bytes(40) == (8 * 32 + (8 + 3) * 32 + 10 * 16 + (8 + 5) * 32) * 2
    assert cost.kv_read_bytes(3) == (3 * 32 + 3 * 32 + 0 + 3 * 32) * 2
    # FLOPs: 4 * H * D per key, plus the indexer's 2 * Hi * Di per scored entry.
    assert cost.attention_flops(40) == 4 * 4 * 32 * (8 + 11 + 13) + 2 * 8 * 16 * 10
    assert cost.attention_flops(1) == 4 * 4 * 32 * 3


def test_kv_write_bytes_match_the_layers_cache_specs():
    """Per token: one entry of each sliding cache, 1/r entry of each compressed cache."""
    model = build(TINY, torch.bfloat16, device="meta")
    per_token = sum(s.kv_spec.entry_bytes / s.kv_spec.compress_ratio for s in model.kv_cache_layers())
    assert DeepseekV4Cost(DeepseekV4Args.from_hf(TINY), 2, 2).kv_write_bytes() == pytest.approx(per_token)


def test_fp8_kv_counts_records(monkeypatch):
    """kv_cache_dtype="fp8": a window row or entry is a 48-byte record (D = 32 with 8 RoPE
    channels: 24 E4M3 + 16 bf16 bytes + 1 scale, padded to 8), what the packed model's specs hold;
    index keys and compressor states stay 2-byte values."""
    cost = DeepseekV4Cost(DeepseekV4Args.from_hf(TINY), 2, 2, kv_cache_dtype="fp8")
    assert cost.kv_row_bytes == [48, 48, 48]
    assert cost.kv_read_bytes(40) == (8 + 8 + 3 + 8 + 5) * 48 + 10 * 16 * 2
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")       # packed records (interpreter)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(TINY, torch.bfloat16, kv_cache_dtype="fp8")
    finally:
        torch.set_default_dtype(previous)
    assert model.packed_kv
    per_token = sum(s.kv_spec.entry_bytes / s.kv_spec.compress_ratio for s in model.kv_cache_layers())
    assert cost.kv_write_bytes() == pytest.approx(per_token)


def test_decode_and_prefill_work():
    cost = DeepseekV4Cost(DeepseekV4Args.from_hf(TINY), 2, 2)
    rows = 64 * 2 + 2 * 8       # embedding row + the hash layer's tid2eid row (K int64 ids)
    step = cost.decode_step(batch=1, context=40, distinct_experts=[2, 2, 2])
    assert step["weight_bytes"] == cost.dense_bytes() + rows + 6 * cost.expert_bytes
    assert step["kv_bytes"] == cost.kv_read_bytes(40) + cost.kv_write_bytes()
    assert step["bytes"] == step["weight_bytes"] + step["kv_bytes"]
    head = 96 * 64
    assert step["flops"] == 2 * (cost.matmul_params_per_token() + head) + cost.attention_flops(40)
    b4 = cost.decode_step(batch=4, context=40)
    assert b4["distinct_experts"] == [pytest.approx(expected_distinct_experts(6, 2, 4))] * 3
    with pytest.raises(ValueError, match="distinct_experts has 2 entries; the model has 3 layers"):
        cost.decode_step(1, 40, [2, 2])
    pre = cost.prefill(batch=2, prompt_len=10)
    attn = sum(cost.attention_flops(s) for s in range(1, 11))
    assert pre["flops"] == 2 * (2 * cost.matmul_params_per_token() * 10 + 2 * head + attn)
    assert pre["kv_bytes"] == pytest.approx(20 * cost.kv_write_bytes())
    assert pre["expert_bytes"] == pytest.approx(sum(pre["distinct_experts"]) * cost.expert_bytes)
    assert pre["expert_flops"] == 2 * 20 * 3 * 2 * 3 * 64 * cost.args.moe_intermediate_size
    assert pre["expert_bytes"] < pre["weight_bytes"] and pre["expert_flops"] < pre["flops"]


def test_expected_distinct_experts():
    assert expected_distinct_experts(256, 6, 1) == pytest.approx(6)
    assert expected_distinct_experts(256, 6, 16) == pytest.approx(80.84, abs=0.01)
    assert expected_distinct_experts(256, 6, 10_000) == pytest.approx(256)


def test_floor_is_the_larger_bound():
    f = floor_ms({"bytes": 4.3e9, "flops": 0.79e12}, hbm_gb_s=4300, matmul_tflop_s=790)
    assert f["bytes_ms"] == pytest.approx(1.0) and f["flops_ms"] == pytest.approx(1.0)
    f = floor_ms({"bytes": 8.6e9, "flops": 0.79e12}, hbm_gb_s=4300, matmul_tflop_s=790)
    assert f["floor_ms"] == pytest.approx(2.0) and f["bound"] == "memory"
    f = floor_ms({"bytes": 1e9, "flops": 7.9e12}, hbm_gb_s=4300, matmul_tflop_s=790)
    assert f["floor_ms"] == pytest.approx(10.0) and f["bound"] == "compute"


def test_parts_floor_bounds_each_part_on_its_own():
    # Experts: 8.6 GB, 0.79 TFLOP -> 2 ms memory-bound; the rest: 0.43 GB, 3.95 TFLOP -> 5 ms compute.
    work = {"bytes": 9.03e9, "flops": 4.74e12, "expert_bytes": 8.6e9, "expert_flops": 0.79e12}
    parts = parts_floor_ms(work, hbm_gb_s=4300, matmul_tflop_s=790)
    assert parts["experts"]["floor_ms"] == pytest.approx(2.0) and parts["experts"]["bound"] == "memory"
    assert parts["rest"]["floor_ms"] == pytest.approx(5.0) and parts["rest"]["bound"] == "compute"
    assert parts["floor_ms"] == pytest.approx(7.0)
    # Tighter than the whole's larger bound (6 ms of FLOPs), never looser.
    assert parts["floor_ms"] >= floor_ms(work, hbm_gb_s=4300, matmul_tflop_s=790)["floor_ms"]


def test_v4_flash_preset_sizes():
    """27.4B parameters, 54.8 GB in bf16 (counted on a model built on the meta device); the
    issue's reference figures for decode and prefill."""
    _, cfg = resolve_config("deepseek-v4-flash")
    model = build(cfg, torch.bfloat16, device="meta")
    sd = model.state_dict()
    cost = DeepseekV4Cost(DeepseekV4Args.from_hf(cfg), 2, 2)
    assert cost.num_params == sum(t.numel() for t in sd.values())
    assert cost.param_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    assert cost.num_params == pytest.approx(27.41e9, rel=1e-3)
    assert cost.param_bytes == pytest.approx(54.84e9, rel=1e-3)
    # Batch 1: dense weights + one embedding row + 6 experts per layer (3.44 GB; the issue's
    # 4.49 GB also counts the whole 1.06 GB embedding table, of which one row is read).
    b1 = cost.decode_step(1, 4096, [6] * 4)
    table = 129280 * 4096 * 2
    assert b1["weight_bytes"] + table == pytest.approx(4.49e9, rel=0.01)
    # Batch 16: about 81 distinct experts per layer; ~4.6 ms at 4.3 TB/s with the whole table.
    b16 = cost.decode_step(16, 4096)
    assert b16["distinct_experts"][0] == pytest.approx(80.8, abs=0.1)
    assert (b16["bytes"] + table) / 4.3e12 * 1e3 == pytest.approx(4.6, rel=0.02)
    # Prefill of 4,096 tokens: about 10.5 TFLOP of useful work.
    assert cost.prefill(1, 4096)["flops"] == pytest.approx(10.5e12, rel=0.01)


def test_probes_measure_positive_rates():
    cpu = torch.device("cpu")
    gbs = measure_hbm_bandwidth(cpu, nbytes=4 << 20, iters=3)
    tflops = measure_matmul_tflops(cpu, n=128, dtype=torch.float32, iters=3)
    assert math.isfinite(gbs) and gbs > 0
    assert math.isfinite(tflops) and tflops > 0
