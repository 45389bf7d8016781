"""``deepinfer bench decode --weights`` on the CPU with the tiny DeepSeek-V4 config: the engine keeps
its random weights in the chosen formats (the CPU runs the reference path), the report says so, and
the floors count the weights as stored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.bench.floors import DeepseekV4Cost
from deepinfer.bench.model_shapes import resolve_config
from deepinfer.entrypoints.cli import main
from deepinfer.models.deepseek_v4 import DeepseekV4Args

from .. import TINY_V4_MODEL

COMMON = ["--num-layers", "2", "--device", "cpu", "--warmup", "1", "--floor-copy-mib", "8",
          "--floor-matmul-n", "128", "--no-hf", "--no-compare-sync", "--batch-size", "2",
          "--context-len", "16", "--steps", "2"]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> str:
    """The tiny DeepSeek-V4 with V4.1's release formats (32 x 32 UE8M0 FP8, FP4 experts)."""
    cfg = json.loads((Path(TINY_V4_MODEL) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [32, 32],
                                  "expert_dtype": "fp4"}
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def run(argv: list[str], out: Path) -> dict:
    assert main(argv + ["--output-json", str(out)]) == 0
    return json.loads(out.read_text())


def test_decode_weights_formats(tiny_config, tmp_path, capsys):
    results = {w: run(["bench", "decode", "--config", tiny_config, *COMMON, "--weights", w], tmp_path / f"{w}.json")
               for w in ("bf16", "fp8", "fp8+fp4")}
    assert capsys.readouterr().out.count("weights in device memory after load") == 3
    bf16, fp8, both = results["bf16"], results["fp8"], results["fp8+fp4"]
    assert (bf16["weights"], fp8["weights"], both["weights"]) == ("float32", "fp8", "fp8+fp4-experts")
    assert bf16["weights_in_memory"]["fp8"] == bf16["weights_in_memory"]["fp4"] == 0
    assert fp8["weights_in_memory"]["fp8"] > 0 and fp8["weights_in_memory"]["fp4"] == 0
    assert both["weights_in_memory"]["fp4"] > 0
    assert both["weights_in_memory"]["total"] < fp8["weights_in_memory"]["total"] < bf16["weights_in_memory"]["total"]
    # The accounting counts the weights as stored: fewer bytes, so a lower floor.
    assert both["param_bytes"] < fp8["param_bytes"] < bf16["param_bytes"]
    assert both["floor"]["weight_bytes"] < bf16["floor"]["weight_bytes"]
    for r in results.values():
        assert r["engine"]["ms_per_step"] > 0


def test_cost_with_weight_formats_counts_fp8_and_fp4_bytes():
    _, cfg = resolve_config("deepseek-v4-flash", 2)
    args = DeepseekV4Args.from_hf(cfg)
    bf16 = DeepseekV4Cost(args, 2, 2)
    quant = DeepseekV4Cost(args, 2, 2)
    quant.with_weight_formats(("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"), 1 + 1 / 128 ** 2, 0.5 + 1 / 32)
    h, i = args.hidden_size, args.moe_intermediate_size
    assert quant.expert_bytes == pytest.approx(3 * h * i * (0.5 + 1 / 32))
    experts = sum(t.nbytes for t in quant.tensors if t.part == "routed_experts")
    assert experts == pytest.approx(2 * args.n_routed_experts * 3 * h * i * (0.5 + 1 / 32))
    q_a = [t for t in quant.tensors if t.name == "q_a_proj"]
    assert q_a[0].elem_bytes == pytest.approx(1 + 1 / 128 ** 2)
    o_a = [t for t in quant.tensors if t.name == "o_a_proj"]
    assert o_a[0].elem_bytes == 2                                       # the grouped o_a stays 16-bit
    assert quant.param_bytes < 0.35 * bf16.param_bytes
