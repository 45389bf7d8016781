"""DeepSeek-V4.1 on CUDA: the tiny reference checkpoint (tests/data/v41_reference) through the
engine, float32 with unrounded KV (greedy must equal the official reference's `_noquant`
continuations) and bf16 with the release KV rounding (runs; greedy agreement reported).

Then the packed KV records: with ``kv_cache_dtype="auto"`` on CUDA the window rows, compressed
entries and index keys are uint8 records (66 / 36 / 17 bytes at the checkpoint's D = 64 and
Di = 32), stored and read by the Triton kernels (decode steps in CUDA graphs). The same model on
the torch backend (``DEEPINFER_KERNEL_BACKEND=torch``, chosen before the engine is built) stores
the same rounded values unpacked: in float32 the greedy tokens must be equal (bf16: agreement
reported, a bf16 model is chaotic under rounding differences). Repeats (prefix-cache hits) are
reported.

Then its engram tables forced into host memory (DEEPINFER_ENGRAM_TABLES=host: FP8 tables mapped
from the file, pinned in place, rows gathered by the Triton kernel through their device-mapped
address) against tables on the device: full-forward logits must be bit-identical, and the
engine's greedy (CUDA graphs, the gathers on their side-stream lane) must equal the reference's.
Exit status 1 on a failure; the last line says OK or FAILED."""

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
from deepinfer.scheduler.kv_cache import kv_bytes_per_token

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "v41_reference"
RECORDS = {("mxfp8", 66), ("nvfp4", 36), ("mxfp4", 17)}
CHUNKED = {"max_num_batched_tokens": 16, "block_size": 4}


def free_device_memory() -> None:
    """Each engine takes most of the device's free memory for its KV cache: after the caller
    drops its engine, return that memory before the next one is built."""
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
        gc.collect()
        torch.cuda.empty_cache()
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
        gc.collect()
        torch.cuda.empty_cache()
    del os.environ["DEEPINFER_ENGRAM_TABLES"]
    return failures


def check_reference(prompts: list[list[int]], e: dict, params: SamplingParams) -> int:
    failures = 0
    for dtype, kv, key, settings in (("float32", "float32", "greedy_noquant", {}),
                                     ("float32", "float32", "greedy_noquant", CHUNKED),
                                     ("bfloat16", "auto", "greedy_bf16_decode", {})):
        t = time.perf_counter()
        llm = LLM(model=str(DATA / "checkpoint"), device="cuda", dtype=dtype, kv_cache_dtype=kv, **settings)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        same = [g == r for g, r in zip(got, e[key].tolist())]
        print(f"{dtype} kv={kv} {settings}: equal to {key}: {sum(same)}/{len(same)}; "
              f"repeat equal: {again == got}; {time.perf_counter() - t:.1f} s", flush=True)
        if dtype == "float32" and not all(same):
            failures += 1
        del llm
        free_device_memory()
    return failures


def check_packed(prompts: list[list[int]], params: SamplingParams) -> int:
    failures = 0
    saved = os.environ.get("DEEPINFER_KERNEL_BACKEND")
    try:
        for dtype, settings in (("float32", {}), ("float32", CHUNKED), ("bfloat16", {})):
            runs = {}
            for choice in ("torch", "auto"):
                os.environ["DEEPINFER_KERNEL_BACKEND"] = choice
                t = time.perf_counter()
                llm = LLM(model=str(DATA / "checkpoint"), device="cuda", dtype=dtype, kv_cache_dtype="auto",
                          **settings)
                model = llm.engine.model
                records = {(s.kv_spec.record, s.kv_cache.shape[-1]) for s in model.kv_cache_layers()
                           if s.kv_spec.record is not None}
                uint8 = all(s.kv_cache.dtype == torch.uint8 for s in model.kv_cache_layers()
                            if s.kv_spec.record is not None)
                packed_ok = (model.packed_kv and records == RECORDS and uint8) if choice == "auto" \
                    else (not model.packed_kv and not records)
                per_token = kv_bytes_per_token(llm.engine.kv.groups)[0]
                runs[choice] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
                print(f"{dtype} auto backend={choice} {settings}: packed={model.packed_kv} layout ok: "
                      f"{packed_ok}; {per_token:.1f} B per token of context; repeat (prefix hits) equal: "
                      f"{again == runs[choice]}; {time.perf_counter() - t:.1f} s", flush=True)
                if not packed_ok:
                    failures += 1
                del llm, model
                free_device_memory()
            same = [a == b for a, b in zip(runs["auto"], runs["torch"])]
            first = [next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
                     for a, b in zip(runs["auto"], runs["torch"]) if a != b]
            print(f"{dtype} {settings}: packed (Triton) greedy equal to unpacked rounded (torch): "
                  f"{sum(same)}/{len(same)}; first divergent positions {first}", flush=True)
            if dtype == "float32" and not all(same):
                failures += 1
    finally:
        if saved is None:
            os.environ.pop("DEEPINFER_KERNEL_BACKEND", None)
        else:
            os.environ["DEEPINFER_KERNEL_BACKEND"] = saved
    return failures


def main() -> int:
    e = np.load(DATA / "expected.npz")
    ids, off = e["prompt_ids"], e["prompt_offsets"]
    prompts = [ids[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    failures = check_reference(prompts, e, params) + check_packed(prompts, params)
    failures += check_host_tables(prompts, e["greedy_noquant"], params)
    print("FAILED" if failures else "OK", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
