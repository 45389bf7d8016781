"""DeepSeek-V4.1 on CUDA: the tiny reference checkpoint (tests/data/v41_reference) through the
engine, float32 with unrounded KV (greedy must equal the official reference's `_noquant`
continuations) and bf16 with the release KV rounding (runs; greedy agreement reported); then
its engram tables forced into host memory (DEEPINFER_ENGRAM_TABLES=host: FP8 tables mapped from
the file, pinned in place, rows gathered by the Triton kernel through their device-mapped
address) against tables on the device: full-forward logits must be bit-identical, and the
engine's greedy (CUDA graphs, the gathers on their side-stream lane) must equal the reference's."""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ModelConfig
from deepinfer.forward_context import ForwardContext
from deepinfer.models.loader import load_model

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "v41_reference"


def free_device_memory() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def check_host_tables(prompts: list[list[int]], expected: np.ndarray, params: SamplingParams) -> int:
    """Host-memory engram tables against device tables; returns the number of failed checks."""
    failures = 0
    device = torch.device("cuda")
    logits = {}
    for placement in ("device", "host"):
        os.environ["DEEPINFER_ENGRAM_TABLES"] = placement
        cfg = ModelConfig.from_path(DATA / "checkpoint", "float32", None, device, kv_cache_dtype="float32")
        model = load_model(cfg, device)
        table = model.model.layers[1].engram.embed
        if placement == "host":
            print(f"host tables: codes on {table.codes.device}, pinned {table.codes.is_pinned()}, "
                  f"codes/scales {table.host.how}", flush=True)
        with torch.no_grad():
            logits[placement] = [model.compute_logits(model(torch.tensor(p, device=device),
                                                            ForwardContext.no_cache([len(p)], device)))
                                 for p in prompts]
        del model
        free_device_memory()
    same = [torch.equal(a, b) for a, b in zip(logits["device"], logits["host"])]
    diff = max(float((a - b).abs().max()) for a, b in zip(logits["device"], logits["host"]))
    print(f"host vs device tables, full forwards: bit-identical logits {sum(same)}/{len(same)} "
          f"(max abs diff {diff:.3g})", flush=True)
    failures += not all(same)
    os.environ["DEEPINFER_ENGRAM_TABLES"] = "host"
    for settings in ({}, {"max_num_batched_tokens": 16, "block_size": 4}):
        t = time.perf_counter()
        llm = LLM(model=str(DATA / "checkpoint"), device="cuda", dtype="float32", kv_cache_dtype="float32",
                  **settings)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        equal = sum(g == r for g, r in zip(got, expected.tolist()))
        print(f"host tables, engine {settings}: equal to greedy_noquant: {equal}/{len(got)}; "
              f"{time.perf_counter() - t:.1f} s", flush=True)
        failures += equal != len(got)
        del llm
        free_device_memory()
    del os.environ["DEEPINFER_ENGRAM_TABLES"]
    return failures


def main() -> int:
    e = np.load(DATA / "expected.npz")
    ids, off = e["prompt_ids"], e["prompt_offsets"]
    prompts = [ids[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    failures = 0
    for dtype, kv, key in (("float32", "float32", "greedy_noquant"), ("bfloat16", "auto", "greedy_bf16_decode")):
        for settings in ({}, {"max_num_batched_tokens": 16, "block_size": 4}):
            t = time.perf_counter()
            llm = LLM(model=str(DATA / "checkpoint"), device="cuda", dtype=dtype, kv_cache_dtype=kv, **settings)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            same = [g == r for g, r in zip(got, e[key].tolist())]
            print(f"{dtype} kv={kv} {settings}: equal to {key}: {sum(same)}/{len(same)}; "
                  f"repeat equal: {again == got}; {time.perf_counter() - t:.1f} s", flush=True)
            if dtype == "float32" and not all(same):
                failures += 1
            # Each engine takes most of the device's free memory for its KV cache: free it first.
            del llm
            free_device_memory()
    failures += check_host_tables(prompts, e["greedy_noquant"], params)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
