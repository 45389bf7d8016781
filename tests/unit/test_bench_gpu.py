"""The benchmarks at DeepSeek-V4-Flash widths on CUDA (run on the GPU machine:
``pytest -m gpu tests/unit/test_bench_gpu.py``); one layer, so each model takes ~7.5 GB.

- the random weights give finite activations at full width in bf16, and HF's model,
  refilled under our names, computes the same logits (bf16 tolerance);
- ``bench decode`` and ``bench prefill`` run end to end; no measured time is below its
  floor (a floor above a measurement would mean the accounting over-counts).
"""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.bench.common import check_finite
from deepinfer.bench.hf_baseline import HFBaseline
from deepinfer.bench.model_shapes import resolve_config
from deepinfer.entrypoints.cli import main
from deepinfer.forward_context import ForwardContext
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM
from deepinfer.models.dummy import init_dummy_weights

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
PROBES = ["--floor-copy-mib", "1024", "--floor-matmul-n", "8192"]


@torch.no_grad()
def test_flash_width_weights_finite_and_shared_with_hf():
    _, cfg = resolve_config("deepseek-v4-flash", 1)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(CUDA):
            ours = DeepseekV4ForCausalLM(cfg, torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(previous)
    init_dummy_weights(ours, seed=0)
    check_finite(ours, CUDA, cfg["vocab_size"], seed=0, num_tokens=300)   # > window, CSA entries
    ids = torch.randint(0, cfg["vocab_size"], (300,), generator=torch.Generator().manual_seed(1)).to(CUDA)
    got = ours.compute_logits(ours(ids, ForwardContext.no_cache([300], CUDA)))
    del ours
    torch.cuda.empty_cache()
    hf = HFBaseline(cfg, torch.bfloat16, CUDA, seed=0)
    want = hf.model(input_ids=ids[None], use_cache=False).logits[0].float()
    hf.close()
    # bf16 at full width, and HF keeps the router in bf16 where we keep float32: a few tokens
    # may route differently, so the check is per token, on the median and the argmax.
    per_token = (got - want).abs().amax(-1) / want.abs().amax(-1)
    assert per_token.median().item() < 0.05
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_decode_and_prefill_not_below_floor(tmp_path):
    out = tmp_path / "decode.json"
    assert main(["bench", "decode", "--num-layers", "1", "--batch-size", "4", "--context-len", "512",
                 "--steps", "8", "--hf-steps", "4", *PROBES, "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["device"] == torch.cuda.get_device_name() and r["dtype"] == "bfloat16"
    assert r["engine"]["tokens_committed"] == 4 * 8
    assert r["floor"]["distinct_experts_source"] == "counted"
    assert r["engine"]["ms_per_step"] >= r["floor"]["floor_ms"]
    assert r["hf"]["ms_per_step"] >= r["floor"]["floor_ms"]

    out = tmp_path / "prefill.json"
    assert main(["bench", "prefill", "--num-layers", "1", "--prompt-len", "1024", "--iters", "2",
                 "--hf-iters", "1", *PROBES, "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["engine"]["ms"] >= r["floor"]["floor_ms"]
    assert r["hf"]["ms"] >= r["floor"]["floor_ms"]
