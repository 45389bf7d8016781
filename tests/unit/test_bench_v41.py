"""DeepSeek-V4.1 in ``deepinfer bench prefill | decode | curve``: the ``deepseek-v4.1-flash``
preset's layer roles at every depth, depth changes of a V4.1 config file, the byte and
FLOP accounting (against built models and by hand), and the benchmark end to end on the
CPU with a V4.1 config of tiny widths and the preset's roles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer.bench.common import model_cost
from deepinfer.bench.floors import DeepseekV41Cost
from deepinfer.bench.model_shapes import DEFAULT_LAYERS, resolve_config, v41_roles, with_num_layers
from deepinfer.config import flatten_text_config
from deepinfer.entrypoints.cli import main
from deepinfer.kv_spec import record_bytes
from deepinfer.models.deepseek_v41 import DeepseekV41Args, DeepseekV41ForCausalLM, layer_roles

PRESET = "deepseek-v4.1-flash"
REFERENCE_CONFIG = Path(__file__).resolve().parent.parent / "data" / "v41_reference" / "checkpoint" / "config.json"
# The preset's roles at 1..6 layers: the release's roles in its order, one layer each.
KINDS = ["source", "reuse", "source", "reindex", "reuse", "reuse"]
RATIOS = [2, 2, 1, 1, 1, 1]


def build(config: dict, dtype: torch.dtype, device: str = "meta") -> DeepseekV41ForCausalLM:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return DeepseekV41ForCausalLM(config, dtype)
    finally:
        torch.set_default_dtype(previous)


# -- the preset --------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 7))
def test_preset_roles_at_each_depth(n):
    label, cfg = resolve_config(PRESET, n)
    assert label == f"{PRESET} ({n} layers)" and cfg["num_hidden_layers"] == n
    roles = layer_roles(cfg)              # the model's own checks pass
    assert [r.kind for r in roles] == KINDS[:n]
    assert [r.ratio for r in roles] == RATIOS[:n] == cfg["compress_ratios"]
    assert roles[0].key_owner and roles[0].entries_from == 0 and roles[0].keys_from == 0
    if n > 1:    # ratio-2 reuse: layer 0's entries and selection
        assert roles[1].entries_from == 0 and roles[1].topk_from == 0
    if n > 2:    # ratio-1 source, key owner, candidate source (its own top-k unrestricted)
        assert roles[2].key_owner and roles[2].candidate_source and not roles[2].restricted
        assert roles[2].entries_from == roles[2].keys_from == 2
    else:
        assert cfg["candidate_source_layer_id"] == -1
    if n > 3:    # reindex inside layer 2's candidate blocks, with layer 2's keys and entries
        assert roles[3].restricted and roles[3].keys_from == 2 and roles[3].entries_from == 2
    for r in roles[4:]:
        assert r.entries_from == 2 and r.topk_from == 3
    assert DeepseekV41Args.from_hf(cfg).roles == tuple(roles)


def test_preset_default_depth_and_release_values():
    label, cfg = resolve_config(PRESET)
    assert DEFAULT_LAYERS[PRESET] == 4 and label == f"{PRESET} (4 layers)"
    assert cfg["architectures"] == ["DeepseekV41ForCausalLM"] and cfg["num_nextn_predict_layers"] == 0
    assert cfg["engram_layer_ids"] == []
    release = dict(hidden_size=5120, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280,
                   o_groups=8, o_lora_rank=1024, n_routed_experts=384, moe_intermediate_size=2304,
                   num_experts_per_tok=6, scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, swiglu_limit=10.0,
                   rms_norm_eps=1e-20, sliding_window=128, index_n_heads=32, index_head_dim=128, index_topk=512,
                   candidate_topk_blocks=2048, candidate_block_size=8, compress_rope_theta=160000.0,
                   rope_theta=10000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, vocab_size=129280)
    assert {k: cfg[k] for k in release} == release
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                                   "beta_fast": 32, "beta_slow": 1}
    with pytest.raises(ValueError, match="must be >= 1"):
        v41_roles(0)


def test_preset_parameter_table_matches_the_built_model():
    """56.37B parameters at 4 layers, 112.8 GB in bf16 (counted on the meta device)."""
    _, cfg = resolve_config(PRESET)
    sd = build(cfg, torch.bfloat16).state_dict()
    cost = DeepseekV41Cost(DeepseekV41Args.from_hf(cfg), 2, 2)
    assert cost.num_params == sum(t.numel() for t in sd.values())
    assert cost.param_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    assert cost.num_params == pytest.approx(56.37e9, rel=1e-3)
    assert cost.param_bytes == pytest.approx(112.76e9, rel=1e-3)


# -- depth changes of a V4.1 config file ----------------------------------------------------
def test_with_num_layers_keeps_a_v41_config_valid():
    """The reference checkpoint's config (release layout: 8 layers [window, window, source,
    reuse, source, reuse, reindex, reuse], engram layers 1 and 2, MTP entries in
    compress_ratios): the first N layers kept as they are, further ones reuse layers."""
    raw = json.loads(REFERENCE_CONFIG.read_text())
    expected = {
        2: (["window", "window"], [], [], -1, [1]),
        3: (["window", "window", "source"], [2], [2], -1, [1, 2]),
        5: (["window", "window", "source", "reuse", "source"], [2, 4], [2, 4], 4, [1, 2]),
        8: (["window", "window", "source", "reuse", "source", "reuse", "reindex", "reuse"], [2, 4], [2, 4, 6], 4,
            [1, 2]),
        10: (["window", "window", "source", "reuse", "source", "reuse", "reindex", "reuse", "reuse", "reuse"],
             [2, 4], [2, 4, 6], 4, [1, 2]),
    }
    for n, (kinds, kv, index, cand, engram) in expected.items():
        cfg = with_num_layers(raw, n)
        assert "text_config" not in cfg and cfg["num_hidden_layers"] == n and cfg["num_nextn_predict_layers"] == 0
        assert len(cfg["compress_ratios"]) == n
        assert [r.kind for r in layer_roles(cfg)] == kinds, n
        assert (cfg["kv_source_layer_ids"], cfg["index_source_layer_ids"]) == (kv, index)
        assert cfg["candidate_source_layer_id"] == cand
        # Each engram layer keeps its own table size.
        assert cfg["engram_layer_ids"] == engram
        assert cfg["engram_num_embeddings"] == [660, 864][:len(engram)]
        DeepseekV41Args.from_hf(cfg)
    # Layers past the config's own read layer 4's entries and layer 6's selection.
    roles = layer_roles(with_num_layers(raw, 10))
    assert roles[9].entries_from == 4 and roles[9].topk_from == 6
    # The preset's own config at another depth: the same roles as the preset there.
    _, cfg = resolve_config(PRESET, 6)
    assert [r.kind for r in layer_roles(with_num_layers(cfg, 3))] == KINDS[:3]


def test_resolve_config_reads_a_release_layout_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(REFERENCE_CONFIG.read_text())
    label, cfg = resolve_config(str(tmp_path), 4)
    assert label == f"{path} (4 layers)" and cfg["model_type"] == "deepseek_v41"
    assert [r.kind for r in layer_roles(cfg)] == ["window", "window", "source", "reuse"]


def test_with_num_layers_refuses_an_invalid_v41_config():
    cfg = flatten_text_config(json.loads(REFERENCE_CONFIG.read_text()))
    cfg["kv_source_layer_ids"] = [2, 4, 5]      # 5 does not index
    with pytest.raises(ValueError, match="must also index"):
        with_num_layers(cfg, 8)


# -- the accounting --------------------------------------------------------------------------
def test_release_record_sizes():
    assert record_bytes("mxfp8", 512) == 528        # window row: 512 E4M3 + 16 scales
    assert record_bytes("nvfp4", 512) == 288        # entry: 256 B of E2M1 pairs + 32 scales
    assert record_bytes("mxfp4", 128) == 68         # index key: 64 B + 4 scales


def test_kv_bytes_and_attention_flops_by_hand():
    """The 4-layer preset [r2 source, r2 reuse, r1 source, r1 reindex] at s = 1000 tokens of
    context: window 128 rows a layer; ratio 2 sees 500 entries, ratio 1 1000; top-512."""
    _, cfg = resolve_config(PRESET, 4)
    cost = DeepseekV41Cost(DeepseekV41Args.from_hf(cfg), 2, 2)
    window = 4 * 128 * 528
    entries = (500 + 500 + 512 + 512) * 288           # layers 0, 1 (all 500), 2, 3 (top 512 of 1000)
    keys = (500 + 1000 + 1000) * 68                   # index sources 0, 2, 3 score every visible key
    assert cost.kv_read_bytes(1000) == window + entries + keys == 1_023_248
    # Early on the window and entries are whatever exists: s = 3 -> 3 rows, 1 and 3 entries.
    assert cost.kv_read_bytes(3) == 4 * 3 * 528 + (1 + 1 + 3 + 3) * 288 + (1 + 3 + 3) * 68
    # Written per token: 4 window rows; layer 0's entry + key over 2 tokens and its kv and
    # gate state rows (512 bf16 each); layer 2's entry + key every token.
    assert cost.kv_write_bytes() == 4 * 528 + (288 + 68) / 2 + 2 * 512 * 2 + (288 + 68)
    # FLOPs: 4 H D per attended key, 2 Hi Di per scored key.
    assert cost.attention_flops(1000) == (4 * 64 * 512 * (4 * 128 + 500 + 500 + 512 + 512)
                                          + 2 * 32 * 128 * (500 + 1000 + 1000))
    step = cost.decode_step(batch=2, context=1000, distinct_experts=[6.0] * 4)
    assert step["kv_bytes"] == 2 * (cost.kv_read_bytes(1000) + cost.kv_write_bytes())
    assert step["weight_bytes"] == cost.dense_bytes() + 2 * 5120 * 2 + 24 * cost.expert_bytes


def test_kv_writes_are_the_models_caches():
    """With the records at their unpacked size (what the torch reference path stores), a token's
    writes are one row of each of the model's sliding and full caches and 1/r of each compressed
    one: the accounting counts exactly the caches the model has, engram's history included."""
    for cfg in (resolve_config(PRESET, 4)[1], with_num_layers(json.loads(REFERENCE_CONFIG.read_text()), 8)):
        model = build(cfg, torch.bfloat16)
        cost = DeepseekV41Cost(DeepseekV41Args.from_hf(cfg), 2, 2)
        cost.window_record = cost.entry_record = 2 * cost.args.head_dim
        cost.key_record = 2 * cost.args.index_head_dim
        specs = [m.kv_spec for m in model.kv_cache_layers()]
        assert cost.kv_write_bytes() == pytest.approx(sum(s.entry_bytes / s.compress_ratio for s in specs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameter_table_with_engram_matches_the_built_model(dtype):
    cfg = with_num_layers(json.loads(REFERENCE_CONFIG.read_text()), 8)
    sd = build(cfg, dtype).state_dict()
    elem = torch.empty((), dtype=dtype).element_size()
    cost = model_cost(cfg, elem, elem)
    assert isinstance(cost, DeepseekV41Cost) and cost.layer_kinds()[6] == "reindex"
    assert cost.num_params == sum(t.numel() for t in sd.values())
    assert cost.param_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    # Read whole every step: all but the embedding and engram tables and the routed experts.
    dense = sum(t.numel() * t.element_size() for n, t in sd.items()
                if ".mlp.experts." not in n and n != "model.embed_tokens.weight" and "engram.embed" not in n)
    assert cost.dense_bytes() == dense
    # Matmul parameters per token: the 2-D weights a token multiplies (not the lookup tables,
    # lm_head or engram's element-wise q/k weights), the mixers, and K experts per layer.
    matmul = sum(t.numel() for n, t in sd.items()
                 if (t.dim() == 2 and n.endswith(".weight") or n.endswith(".fn"))
                 and not n.startswith(("model.embed_tokens", "lm_head")) and "engram.embed" not in n)
    assert cost.matmul_params_per_token() == matmul + 8 * 2 * cost.expert_bytes // elem
    # A token reads an embedding row and 3 orders x 2 heads rows of 32 of each engram table.
    assert cost.token_row_bytes() == (64 + 2 * 6 * 32) * elem


# -- end to end on the CPU ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_v41_config(tmp_path_factory) -> str:
    """The preset at 4 layers (its roles, release layout otherwise) at tiny widths, as a file."""
    _, cfg = resolve_config(PRESET, 4)
    cfg.update(vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, head_dim=64,
               qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8,
               num_experts_per_tok=2, sliding_window=8, index_n_heads=4, index_head_dim=32, index_topk=4,
               candidate_topk_blocks=3, candidate_block_size=4)
    path = tmp_path_factory.mktemp("v41") / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


# Small probes, a small token budget (the engine's profiling forward), one warm-up step.
COMMON = ["--device", "cpu", "--warmup", "1", "--floor-copy-mib", "8", "--floor-matmul-n", "128",
          "--max-num-batched-tokens", "128"]


def run(argv: list[str], out: Path) -> dict:
    assert main(argv + ["--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_decode_runs_v41_under_the_harness(tiny_v41_config, tmp_path, capsys):
    batch, steps, context = 3, 3, 40
    r = run(["bench", "decode", "--config", tiny_v41_config, "--num-layers", "4", *COMMON, "--batch-size",
             str(batch), "--context-len", str(context), "--steps", str(steps), "--no-compare-sync"],
            tmp_path / "d.json")
    assert r["bench"] == "decode" and r["num_layers"] == 4 and r["layer_types"] == KINDS[:4]
    e, f = r["engine"], r["floor"]
    assert e["tokens_committed"] == batch * steps and e["min_tokens_per_step"] == batch
    assert f["distinct_experts_source"] == "counted" and len(f["distinct_experts"]) == 4
    # The floor is the accounting's, at the window's middle context.
    cfg = json.loads(Path(tiny_v41_config).read_text())
    cost = DeepseekV41Cost(DeepseekV41Args.from_hf(cfg), 4, 4)
    assert f["context_at"] == context + 1 + (steps + 1) // 2
    assert f["kv_bytes"] == pytest.approx(batch * (cost.kv_read_bytes(f["context_at"]) + cost.kv_write_bytes()))
    assert r["params"] == cost.num_params and r["engine_over_floor"] > 0
    # transformers has no DeepSeek-V4.1: the baseline is reported skipped, not fatal.
    assert "deepseek_v41" in r["hf"]["skipped"]
    out = capsys.readouterr().out
    assert "B=3" in out and "HF transformers skipped" in out


@pytest.mark.parametrize("graphs", ["--drafter-graphs", "--no-drafter-graphs"])
def test_decode_with_the_dspark_drafter_counts_graph_steps(tiny_v41_config, tmp_path, capsys, graphs):
    """--spec-method dspark: the report counts the drafter's steps that replayed CUDA graphs (none
    on the CPU, where the decode graphs are off) and records --drafter-graphs."""
    batch, steps = 2, 2
    r = run(["bench", "decode", "--config", tiny_v41_config, "--num-layers", "4", *COMMON, "--batch-size",
             str(batch), "--context-len", "20", "--steps", str(steps), "--no-compare-sync", "--no-hf",
             "--speculative", "2", "--spec-method", "dspark", graphs], tmp_path / "d.json")
    assert r["speculative"]["method"] == "dspark"
    assert r["speculative"]["drafter_graphs"] is (graphs == "--drafter-graphs")
    c = r["spec"]["spec_counters"]
    assert c["drafts"] == steps * batch and c["drafter_graph_steps"] == c["draft_graph_proposals"] == 0
    assert f"drafter: 0 of {steps} forwards and 0 proposals through CUDA graphs" in capsys.readouterr().out


def test_prefill_and_curve_run_v41_under_the_harness(tiny_v41_config, tmp_path):
    r = run(["bench", "prefill", "--config", tiny_v41_config, "--num-layers", "5", *COMMON, "--prompt-len", "24",
             "--batch-size", "2", "--iters", "1", "--no-hf"], tmp_path / "p.json")
    # --num-layers 5 on the file: one more ratio-1 reuse layer.
    assert r["layer_types"] == KINDS[:5] and r["hf"] is None
    assert r["engine"]["steps_per_round"] == [1] and r["floor"]["flops"] > 0 and r["parts_floor"]["floor_ms"] > 0
    c = run(["bench", "curve", "--config", tiny_v41_config, *COMMON, "--batch-sizes", "1,2", "--context-len", "12",
             "--steps", "2", "--no-hf"], tmp_path / "c.json")
    assert c["num_layers"] == 4 and [p["engine"]["tokens_committed"] for p in c["points"]] == [2, 4]


def test_packed_caches_are_the_release_records(monkeypatch):
    """Built for the Triton kernels (CUDA; here the interpreter), ``kv_cache_dtype="auto"``
    declares the release's packed records: a token's writes are what the floors count, and the
    release config's compressed caches hold 890 B per token of context."""
    monkeypatch.setenv("DEEPINFER_KERNEL_BACKEND", "triton")
    for cfg in (resolve_config(PRESET, 4)[1], with_num_layers(json.loads(REFERENCE_CONFIG.read_text()), 8)):
        model = build(cfg, torch.bfloat16)
        assert model.packed_kv
        specs = [m.kv_spec for m in model.kv_cache_layers()]
        assert {(s.record, s.entry_bytes) for s in specs if s.record} == {
            ("mxfp8", record_bytes("mxfp8", cfg["head_dim"])), ("nvfp4", record_bytes("nvfp4", cfg["head_dim"])),
            ("mxfp4", record_bytes("mxfp4", cfg["index_head_dim"]))}
        cost = DeepseekV41Cost(DeepseekV41Args.from_hf(cfg), 2, 2)
        assert cost.kv_write_bytes() == pytest.approx(sum(s.entry_bytes / s.compress_ratio for s in specs))
    # The release's 40 layers (deepseek_v41.md §2): ratio-2 sources 2, 8, 14, ratio-1 source 20.
    _, release = resolve_config(PRESET, 40)
    release.update(compress_ratios=[0, 0] + [2] * 18 + [1] * 20, kv_source_layer_ids=[2, 8, 14, 20],
                   index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], candidate_source_layer_id=20)
    specs = [m.kv_spec for m in build(release, torch.bfloat16).kv_cache_layers()]
    assert sum(s.entry_bytes / s.compress_ratio for s in specs if s.kind != "sliding") == 890
