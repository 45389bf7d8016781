"""``deepinfer bench prefill | decode | curve`` end to end on the CPU with a 2-layer tiny
DeepSeek-V4 config (random weights): exit status, the printed table, and the JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from deepinfer.entrypoints.cli import main

from .. import TINY_V4_MODEL

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
# Small probes keep the floor measurement quick on the CPU.
COMMON = ["--num-layers", "2", "--device", "cpu", "--warmup", "1", "--floor-copy-mib", "8",
          "--floor-matmul-n", "128"]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    """The tiny DeepSeek-V4's config with one CSA and one HCA layer (ratio 16)."""
    cfg = json.loads((Path(TINY_V4_MODEL) / "config.json").read_text())
    cfg["layer_types"] = [CSA, HCA] + cfg["layer_types"][2:]
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def run(argv: list[str], out: Path) -> dict:
    assert main(argv + ["--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def positive(d: dict, *keys: str) -> None:
    for k in keys:
        assert isinstance(d[k], (int, float)) and d[k] > 0, (k, d[k])


def check_header(result: dict, kind: str) -> None:
    assert result["bench"] == kind and result["num_layers"] == 2
    assert result["layer_types"] == [CSA, HCA]
    positive(result, "params", "param_bytes")
    positive(result["measured"], "hbm_gb_s", "matmul_tflop_s")
    assert result["nextn"] == 0 and result["cp"] == 1


def test_decode(tiny_config, tmp_path, capsys):
    batch, steps = 3, 4
    r = run(["bench", "decode", "--config", tiny_config, *COMMON, "--batch-size", str(batch),
             "--context-len", "40", "--steps", str(steps), "--hf-steps", "2"], tmp_path / "d.json")
    check_header(r, "decode")
    e, f, hf = r["engine"], r["floor"], r["hf"]
    positive(e, "ms_per_step", "steps_per_s", "full_acceptance_tok_s", "effective_tok_s", "per_user_tok_s",
             "prefill_s")
    # Full acceptance: SPS x requests x (1 + nextn) / cp; effective: tokens committed in the window.
    assert e["full_acceptance_tok_s"] == pytest.approx(e["steps_per_s"] * batch)
    assert e["tokens_committed"] == batch * steps and e["min_tokens_per_step"] == batch
    assert e["ms_per_step"] == pytest.approx(1e3 / e["steps_per_s"])
    # The same window again with overlapped scheduling off: every step waited for the last one.
    w = e["without_overlap"]
    positive(w, "ms_per_step")
    assert w["steps"] == steps and w["overlapped_steps"] == 0 and e["overlapped_steps"] == steps
    positive(f, "weight_bytes", "kv_bytes", "bytes", "flops", "floor_ms")
    assert f["distinct_experts_source"] == "counted"
    assert all(1 <= x <= 8 for x in f["distinct_experts"])    # 8 experts, 2 per token
    assert r["engine_over_floor"] == pytest.approx(e["ms_per_step"] / f["floor_ms"])
    positive(hf, "ms_per_step")
    assert hf["context_len"] == 40
    table = capsys.readouterr().out
    assert "ms/step" in table and "B=3" in table and "HF ms/step" in table


def test_prefill(tiny_config, tmp_path, capsys):
    r = run(["bench", "prefill", "--config", tiny_config, *COMMON, "--prompt-len", "48", "--batch-size", "2",
             "--iters", "2", "--hf-iters", "1"], tmp_path / "p.json")
    check_header(r, "prefill")
    e, f = r["engine"], r["floor"]
    assert len(e["round_ms"]) == 2 and e["steps_per_round"] == [1, 1]
    positive(e, "ms", "input_tok_s", "input_tok_s_per_gpu")
    assert e["input_tok_s"] == pytest.approx(2 * 48 / (e["ms"] * 1e-3))
    positive(f, "flops", "bytes", "floor_ms")
    positive(r, "engine_over_floor", "matmul_peak_share", "steady_matmul_peak_share", "steady_matmul_after_share")
    positive(r["measured"], "matmul_tflop_s_after")
    assert r["steady_matmul_after_share"] == pytest.approx(
        r["steady_matmul_peak_share"] * r["measured"]["matmul_tflop_s"] / r["measured"]["matmul_tflop_s_after"])
    # Steady: (1 warm-up + 2 timed + 1 behind the window) x 2 prompts queued at once, 2
    # prompts a step. The window opens when the warm-up step lands, after the first timed
    # step was launched behind it, and closes when the last timed step lands, after the step
    # behind it was launched: two launches inside the window, each overlapped.
    st = e["steady"]
    positive(st, "ms", "input_tok_s_per_gpu")
    assert st["input_tok_s_per_gpu"] == pytest.approx(2 * 48 / (st["ms"] * 1e-3))
    assert st["steps"] == st["overlapped_steps"] == 2
    positive(r["hf"], "ms", "input_tok_s")
    out = capsys.readouterr().out
    assert "input tok/s/GPU" in out and "engine, steady" in out and "right after the steady window" in out


def test_prefill_chunked_over_steps(tiny_config, tmp_path):
    prof = tmp_path / "prof.txt"
    r = run(["bench", "prefill", "--config", tiny_config, *COMMON, "--prompt-len", "48", "--iters", "1",
             "--max-num-batched-tokens", "16", "--no-hf", "--profile", str(prof)], tmp_path / "p.json")
    assert r["engine"]["steps_per_round"] == [3] and r["hf"] is None
    # The profile of one more round: a header and the profiler's table.
    head, _, table = prof.read_text().partition("\n\n")
    assert head.startswith("1 prefill round:") and "Name" in table


def test_curve(tiny_config, tmp_path):
    out = tmp_path / "c.json"
    r = run(["bench", "curve", "--config", tiny_config, *COMMON, "--batch-sizes", "4,1,2", "--context-len", "20",
             "--steps", "2", "--no-hf"], out)
    check_header(r, "curve")
    assert [p["batch"] for p in r["points"]] == [1, 2, 4]
    c = r["curve"]
    assert c["batch"] == [1, 2, 4]
    for key in ("tok_s_per_gpu", "tok_s_per_user", "floor_tok_s_per_gpu", "floor_tok_s_per_user"):
        assert len(c[key]) == 3 and all(v > 0 for v in c[key]), key
    assert c["hf_tok_s_per_gpu"] == [None] * 3
    for p in r["points"]:
        assert p["engine"]["tokens_committed"] == 2 * p["batch"]
    png = out.with_suffix(".png")
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not png.exists()


SPEC_KEYS = ("ms_per_step", "steps_per_s", "full_acceptance_tok_s", "full_acceptance_tok_s_per_user",
             "effective_tok_s", "per_user_tok_s", "tau", "tau_per_verification", "acceptance_rate",
             "per_user_over_no_spec", "step_over_plain_step", "full_width_steps", "spec_counters", "assumed")


def test_decode_speculative_fixed(tiny_config, tmp_path, capsys):
    """--speculative 3: the same point without then with speculation on one engine; the fixed
    drafter makes every timed step verify 1 + 3 tokens per request, so the assumed figure
    (nextn 3) comes from its measured step time."""
    batch, steps, n = 2, 3, 3
    r = run(["bench", "decode", "--config", tiny_config, *COMMON, "--batch-size", str(batch), "--context-len", "20",
             "--steps", str(steps), "--no-hf", "--no-compare-sync", "--speculative", str(n)], tmp_path / "d.json")
    assert r["nextn"] == 0     # the header's: the plain measurement
    assert r["speculative"]["method"] == "fixed" and r["speculative"]["num_speculative_tokens"] == n
    assert "random weights" in r["speculative"]["note"]
    e, s = r["engine"], r["spec"]
    assert e["spec_counters"] == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "graph_verifications": 0,
                                  "drafter_graph_steps": 0, "draft_graph_proposals": 0}
    assert e["tokens_committed"] == batch * steps
    assert set(SPEC_KEYS) <= set(s)
    c = s["spec_counters"]
    assert c["drafts"] == steps * batch and c["draft_tokens"] == n * c["drafts"] and s["full_width_steps"]
    # tau from the counters: tokens committed per request per step, the target's own included.
    assert s["tau"] == pytest.approx(1 + c["accepted_tokens"] / (steps * batch))
    assert s["tokens_committed"] == steps * batch + c["accepted_tokens"]
    assert s["full_acceptance_tok_s"] == pytest.approx(s["steps_per_s"] * batch * (1 + n))
    assert s["effective_tok_s"] == pytest.approx(s["tokens_committed"] / (steps * s["ms_per_step"] * 1e-3))
    assert s["per_user_over_no_spec"] == pytest.approx(s["per_user_tok_s"] / e["per_user_tok_s"])
    assert s["step_over_plain_step"] == pytest.approx(s["ms_per_step"] / e["ms_per_step"])
    a = s["assumed"]
    assert "assumed" in a["label"] and a["nextn"] == 3 and a["acceptance"] == 0.75 and a["unavailable"] is None
    assert a["tau"] == pytest.approx(3.25)
    assert a["tok_s_per_gpu"] == pytest.approx(s["steps_per_s"] * batch * 3.25)
    assert a["tok_s_per_user"] == pytest.approx(s["steps_per_s"] * 3.25)
    out = capsys.readouterr().out
    assert "tok/s assumed" in out and "x no-spec user" in out and "a verification step (4 tokens/request)" in out
    assert "random weights: the drafts' acceptance is not meaningful" in out


def test_curve_speculative_ngram(tiny_config, tmp_path, capsys):
    """--spec-method ngram at N=2: the engine's own drafter; the assumed figure (nextn 3) needs a
    run at width 4, so it is None, and the report says so."""
    r = run(["bench", "curve", "--config", tiny_config, *COMMON, "--batch-sizes", "1,2", "--context-len", "20",
             "--steps", "2", "--no-hf", "--speculative", "2", "--spec-method", "ngram"], tmp_path / "c.json")
    assert r["speculative"]["method"] == "ngram"
    c = r["curve"]
    for key in ("spec_full_acceptance_tok_s_per_gpu", "spec_full_acceptance_tok_s_per_user",
                "spec_effective_tok_s_per_gpu", "spec_effective_tok_s_per_user"):
        assert len(c[key]) == 2 and all(v > 0 for v in c[key]), key
    assert c["assumed_tok_s_per_gpu"] == c["assumed_tok_s_per_user"] == [None, None]
    for p in r["points"]:
        s = p["spec"]
        assert set(SPEC_KEYS) <= set(s) and s["assumed"]["unavailable"].startswith("needs")
        assert s["spec_counters"]["draft_tokens"] <= 2 * s["spec_counters"]["drafts"]
        assert s["tokens_committed"] == 2 * p["batch"] + s["spec_counters"]["accepted_tokens"]
    assert "assumed acceptance: needs" in capsys.readouterr().out


def test_bad_arguments_fail_clearly(tiny_config, tmp_path, capsys):
    assert main(["bench", "decode", "--config", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                    "num_hidden_layers": 2}))
    assert main(["bench", "prefill", "--config", str(llama), "--device", "cpu"]) == 2
    assert "DeepseekV41ForCausalLM only" in capsys.readouterr().err
    assert main(["bench", "curve", "--config", tiny_config, "--batch-sizes", "1,x", "--device", "cpu"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "decode", "--config", tiny_config, "--steps", "0", "--device", "cpu"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
    assert main(["bench", "decode", "--config", tiny_config, "--speculative", "-1", "--device", "cpu"]) == 2
    assert "--speculative must be >= 0" in capsys.readouterr().err


def test_bench_engine_is_frozen_then_released(tiny_config):
    """build_engine moves the live heap (the engine's KV-block objects among it) to the GC's
    permanent generation, so full collections inside timed windows skip it; free_memory
    unfreezes, so a released engine's cycles are collected again."""
    import gc

    from deepinfer.bench.common import BenchModel, build_engine, free_memory
    from deepinfer.entrypoints.cli import build_parser

    args = build_parser().parse_args(["bench", "decode", "--config", tiny_config, *COMMON])
    model = BenchModel.from_args(args)
    engine = build_engine(model, args, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64)
    try:
        assert gc.get_freeze_count() >= engine.kv.pool.num_blocks
    finally:
        del engine
        free_memory(model.device)
    assert gc.get_freeze_count() == 0


def test_profile_kernel_total_leaves_out_our_ranges():
    """The profile header's kernel time sums device work only: the GPU-side spans of the
    runner's record_function ranges are device events too and cover the same kernels."""
    from types import SimpleNamespace

    from deepinfer.bench.common import device_kernels
    cuda, cpu = "DeviceType.CUDA", "DeviceType.CPU"
    events = [SimpleNamespace(key="_gate_up_kernel", device_type=cuda, is_user_annotation=False),
              SimpleNamespace(key="deepinfer.forward", device_type=cuda, is_user_annotation=True),
              SimpleNamespace(key="deepinfer.prepare", device_type=cuda),            # older torch: no flag
              SimpleNamespace(key="aten::mm", device_type=cpu, is_user_annotation=False),
              SimpleNamespace(key="Memcpy HtoD (Pinned -> Device)", device_type=cuda, is_user_annotation=False)]
    assert [e.key for e in device_kernels(events)] == ["_gate_up_kernel", "Memcpy HtoD (Pinned -> Device)"]


def test_steady_device_time_is_busy_plus_idle_per_batch():
    from deepinfer.bench.prefill import steady_device_ms
    st = {"ms": 29.0, "gpu_busy_ms_per_step": 9.5, "gpu_idle_ms_per_step": 0.25}
    assert steady_device_ms(st, 3) == pytest.approx(29.25)
    assert steady_device_ms({"ms": 1.0, "gpu_busy_ms_per_step": None}, 1) is None


def test_bench_multiturn_hits_with_caching_only(tmp_path):
    """Two conversations of two turns after a 40-token system prompt: with caching on, the
    second turn reuses the conversation so far (at 16-token granularity); off, nothing."""
    from deepinfer.entrypoints.llm import DEFAULT_MODEL

    out = run(["bench", "multiturn", "--config", DEFAULT_MODEL, "--device", "cpu", "--system-len", "40",
               "--conversations", "2", "--turns", "2", "--question-len", "8", "--answer-len", "4"],
              tmp_path / "multiturn.json")
    on, off = out["runs"]["on"], out["runs"]["off"]
    assert on["prompt_tokens"] == off["prompt_tokens"] == 2 * (48 + 60)
    assert off["cached_tokens"] == 0 and off["prefix_hit_rate"] == 0
    # Turn 2 (60 tokens) hits the first turn's 52 computed tokens rounded down to 16: 48.
    assert on["cached_tokens"] >= 2 * 48 and on["hit_step"] == 16
    assert 0 < on["prefix_hit_rate"] < 1
    assert len(on["ttft_ms_per_turn"]) == 2 and all(t["mean"] > 0 for t in on["ttft_ms_per_turn"])


@pytest.mark.slow
def test_bench_multiturn_host_and_disk_tiers(tmp_path):
    """A device cache too small for the conversations: the host tier serves some of the later
    turns' prefixes, and after a restart the disk tier serves the whole workload's."""
    from deepinfer.entrypoints.llm import DEFAULT_MODEL

    out = run(["bench", "multiturn", "--config", DEFAULT_MODEL, "--device", "cpu", "--system-len", "200",
               "--conversations", "4", "--turns", "3", "--question-len", "32", "--answer-len", "16",
               "--num-kv-blocks", "40", "--settings", "on,host,disk", "--warmup-conversations", "1",
               "--kv-offload-gib", "0.05", "--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-gib", "0.1"],
              tmp_path / "multiturn.json")
    on, host, disk = out["runs"]["on"], out["runs"]["host"], out["runs"]["disk"]
    assert on["tier_hit_rate"] == {"host": 0, "disk": 0} and not on["transfers"]
    assert host["tier_hit_rate"]["host"] > 0 and host["cached_tokens"] > on["cached_tokens"]
    assert host["transfers"]["host_to_device"]["bytes"] > 0
    assert disk["tier_hit_rate"]["disk"] > 0 and disk["cached_tokens"] > on["cached_tokens"]
    assert list((tmp_path / "kv").iterdir())


def test_decode_and_prefill_batch_invariant_cost(tiny_config, tmp_path, capsys):
    """--batch-invariant measures the same model in the mode in the same run and reports its
    time against the normal mode's."""
    d = run(["bench", "decode", "--config", tiny_config, *COMMON, "--batch-size", "2", "--context-len", "24",
             "--steps", "3", "--no-hf", "--no-compare-sync", "--batch-invariant",
             "--profile", str(tmp_path / "prof.txt")], tmp_path / "d.json")
    bi = d["batch_invariant"]
    positive(bi, "ms_per_step", "slowdown")
    # --profile: each mode's decode steps in their own file.
    assert all("decode steps" in (tmp_path / name).read_text() for name in ("prof.txt", "prof.batch-invariant.txt"))
    assert bi["slowdown"] == pytest.approx(bi["ms_per_step"] / d["engine"]["ms_per_step"])
    p = run(["bench", "prefill", "--config", tiny_config, *COMMON, "--prompt-len", "32", "--iters", "1",
             "--no-hf", "--batch-invariant"], tmp_path / "p.json")
    positive(p["batch_invariant"], "ms", "slowdown")
    assert p["batch_invariant"]["slowdown"] == pytest.approx(p["batch_invariant"]["ms"] / p["engine"]["ms"])
    assert "batch-invariant mode:" in capsys.readouterr().out
    c = run(["bench", "curve", "--config", tiny_config, *COMMON, "--batch-sizes", "1,2", "--context-len", "20",
             "--steps", "2", "--no-hf", "--batch-invariant"], tmp_path / "c.json")
    for point in c["points"]:
        positive(point["batch_invariant"], "ms_per_step", "slowdown")
        assert point["batch_invariant"]["slowdown"] == pytest.approx(
            point["batch_invariant"]["ms_per_step"] / point["engine"]["ms_per_step"])
    assert "B=2: batch-invariant mode" in capsys.readouterr().out


@pytest.mark.slow
def test_prefill_context_parallel_counts_every_rank(tiny_config, tmp_path):
    # Two gloo ranks each computing half of every prompt: per-GPU figures count both devices.
    r = run(["bench", "prefill", "--config", tiny_config, *COMMON, "--prompt-len", "48", "--iters", "1",
             "--no-hf", "--cp", "2"], tmp_path / "cp.json")
    assert r["cp"] == r["num_gpus"] == 2
    e, f = r["engine"], r["floor"]
    assert e["input_tok_s_per_gpu"] == pytest.approx(e["input_tok_s"] / 2)
    assert e["steady"]["input_tok_s_per_gpu"] == pytest.approx(48 / (e["steady"]["ms"] * 1e-3) / 2)
    assert r["engine_over_floor"] == pytest.approx(e["ms"] * 2 / f["floor_ms"])
    assert r["weights_in_memory"] is None


def test_profile_splits_matmuls_from_the_rest():
    """The profile's split: cuBLAS and our GEMM kernels on one side, the rest (norms, routing,
    attention) on the other, per unit, with the costliest of the rest named."""
    from types import SimpleNamespace

    from deepinfer.bench.common import is_matmul_kernel, kernel_split
    names = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": True, "_gemm_kernel": True,
             "nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NNT": True,
             "_fp4g_gate_up_kernel": True, "_fp4g_down_kernel": True, "_bmm_kernel": True,
             "_rms_norm_kernel": False, "_hc_pre_kernel": False, "_sparse_attention_decode_kernel": False}
    assert {n: is_matmul_kernel(n) for n in names} == names
    kernels = [SimpleNamespace(key="_gemm_kernel", self_device_time_total=400.0, count=8),
               SimpleNamespace(key="_rms_norm_kernel", self_device_time_total=60.0, count=20),
               SimpleNamespace(key="_hc_pre_kernel", self_device_time_total=140.0, count=36)]
    lines = kernel_split(kernels, units=4).splitlines()
    assert lines[0] == "matmuls: 0.100 ms/unit in 2 launches/unit"
    assert lines[1] == "outside matmuls: 0.050 ms/unit in 14 launches/unit"
    assert lines[2].strip().startswith("_hc_pre_kernel: 35.0 us/unit, 9.0/unit")
