"""``deepinfer bench prefill | decode | curve`` fit the machine: with no --config the CPU runs
the embedded tiny model at CPU-sized lengths, and a model the device cannot hold is refused
before anything is allocated, with the bytes it needs and the bytes free."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.bench import common, curve, decode, fit, prefill
from deepinfer.bench.args import DEVICE_DEFAULTS, apply_device_defaults
from deepinfer.bench.floors import DeepseekV4Cost
from deepinfer.bench.model_shapes import resolve_config
from deepinfer.entrypoints.cli import build_parser, main
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.models.deepseek_v4 import DeepseekV4Args

GIB = 1 << 30
# Keeps each run to a few seconds; the model, lengths and batch sizes are the defaults.
FAST = {"prefill": ["--iters", "1", "--warmup", "0"],
        "decode": ["--steps", "2", "--warmup", "0", "--no-compare-sync"],
        "curve": ["--steps", "2", "--warmup", "0"]}


@pytest.fixture
def cpu_only(monkeypatch):
    """As on a machine without CUDA (``--device auto`` resolves to the CPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("kind", ["prefill", "decode", "curve"])
def test_no_config_on_the_cpu_runs_the_embedded_model(kind, cpu_only, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["bench", kind, *FAST[kind], "--no-hf", "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    layers = json.loads(open(f"{DEFAULT_MODEL}/config.json").read())["text_config"]["num_hidden_layers"]
    assert r["model"] == f"{DEFAULT_MODEL}/config.json ({layers} layers)"
    assert r["device"].startswith("CPU") and r["dtype"] == "float32"
    cpu = DEVICE_DEFAULTS["cpu"]
    assert r["measured"]["copy_bytes"] == cpu["floor_copy_mib"] << 20
    assert r["measured"]["matmul_n"] == cpu["floor_matmul_n"]
    if kind == "prefill":
        assert r["prompt_len"] == cpu["prefill"]["prompt_len"]
    elif kind == "decode":
        assert r["context_len"] == cpu["decode"]["context_len"] and r["engine"]["tokens_committed"] == 2
    else:
        assert [p["batch"] for p in r["points"]] == [int(b) for b in cpu["curve"]["batch_sizes"].split(",")]
        assert r["context_len"] == cpu["curve"]["context_len"]
    # The fit check ran and recorded its figures.
    m = r["memory"]
    assert m["total"] == m["param_bytes"] + m["kv_bytes"] + m["margin_bytes"] <= m["free"]
    assert m["param_bytes"] == r["param_bytes"]


def test_defaults_follow_the_device_and_keep_what_is_given():
    args = build_parser().parse_args(["bench", "curve", "--context-len", "64"])
    apply_device_defaults(args, "cuda")
    assert (args.config, args.context_len, args.batch_sizes, args.floor_copy_mib) == \
        ("deepseek-v4-flash", 64, DEVICE_DEFAULTS["cuda"]["curve"]["batch_sizes"], 2048)
    args = build_parser().parse_args(["bench", "prefill", "--model", "deepseek-v4.1-flash"])
    apply_device_defaults(args, "cpu")
    assert (args.config, args.prompt_len, args.floor_matmul_n) == ("deepseek-v4.1-flash", 256, 512)


def never(*_args, **_kwargs):
    raise AssertionError("allocated before the fit check refused the model")


@pytest.mark.parametrize("kind", ["prefill", "decode", "curve"])
def test_a_preset_that_does_not_fit_is_refused_before_allocating(kind, monkeypatch, capsys):
    free = 8 * GIB
    monkeypatch.setattr(fit, "available_bytes", lambda device: free)
    module = {"prefill": prefill, "decode": decode, "curve": curve}[kind]
    monkeypatch.setattr(module, "measure_floors", never)     # the first allocation, then the engine
    monkeypatch.setattr(module, "build_engine", never)
    assert main(["bench", kind, "--config", "deepseek-v4-flash", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    # The bytes needed: the weights counted from the config's shapes (float32 on the CPU), the
    # CPU cache budget (more than these runs' KV) and the margin.
    _, cfg = resolve_config("deepseek-v4-flash", 4)
    params = DeepseekV4Cost(DeepseekV4Args.from_hf(cfg), 4, 4, False).param_bytes
    need = params + common.CPU_KV_CACHE_BYTES + int(fit.MARGIN_SHARE * params) + fit.MARGIN_BYTES
    assert f"deepseek-v4-flash (4 layers) does not fit on the CPU: it needs {need:,} bytes" in err
    assert f"{params / GIB:.1f} GiB of weights" in err and f"and {free:,} bytes (8.0 GiB) are free" in err


def test_fit_check_on_cuda_reads_free_device_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 80 * GIB))
    cuda = torch.device("cuda")
    assert fit.available_bytes(cuda) == 70 * GIB
    # One layer of V4-Flash fits an 80 GB card, four of V4.1-Flash (112.8 GB in bf16) do not.
    for preset, layers, fits in (("deepseek-v4-flash", 1, True), ("deepseek-v4.1-flash", 4, False)):
        _, cfg = resolve_config(preset, layers)
        model = common.BenchModel(preset, cfg, cuda, torch.bfloat16, common.model_cost(cfg, 2, 2))
        if fits:
            need = model.check_fits(kv_tokens=4096)
            assert need["kv_bytes"] == int(4096 * model.cost.kv_write_bytes()) > 0
            assert need["total"] < 70 * GIB
        else:
            with pytest.raises(ValueError, match=r"does not fit on CUDA: it needs .* and 75,161,927,680 bytes"):
                model.check_fits(kv_tokens=4096)


def test_host_memory_reads_meminfo_and_the_cgroup_limit(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683784 kB\nMemFree:         1000 kB\nMemAvailable:   15965064 kB\n")
    assert fit._meminfo_available(str(meminfo)) == 15965064 * 1024
    assert fit._meminfo_available(str(tmp_path / "missing")) is None
    monkeypatch.setattr(fit, "_meminfo_available", lambda: 16 * GIB)
    monkeypatch.setattr(fit, "_cgroup_headroom", lambda: 3 * GIB)
    assert fit.host_available_bytes() == 3 * GIB
    monkeypatch.setattr(fit, "_cgroup_headroom", lambda: None)
    assert fit.host_available_bytes() == 16 * GIB
