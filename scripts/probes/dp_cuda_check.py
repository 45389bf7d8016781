"""Attention data parallelism on CUDA (2 GPUs, NCCL): ``ep=2, dp=2`` engines against the
single-process engine on the tiny DeepSeek-V4 and the embedded DeepSeek-V4.1, in float32
(V4.1 with a float32 KV cache): a batch of prompts of different lengths spread over both
data-parallel ranks, then one request alone (the other rank on dummy forwards). Greedy tokens
must be equal and the sampled logprobs within 1e-4; the biggest difference is reported.
Writes ``dp_cuda_check.json`` to $OUT (or the working directory). Exit status 1 on a failure;
the last line says OK or FAILED.

    python scripts/probes/dp_cuda_check.py
    DP_PROBE_DEVICE=cpu python scripts/probes/dp_cuda_check.py    # dry run on the CPU (gloo)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from deepinfer import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
TOL = 1e-4
DEVICE = os.environ.get("DP_PROBE_DEVICE", "cuda")
MODELS = {"tiny-v4": dict(model=str(REPO / "tests" / "data" / "tiny-v4-model")),
          "v41": dict(kv_cache_dtype="float32")}


def prompts(lens: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]


def run(kw: dict, **parallel) -> tuple[list, float, list[int]]:
    llm = LLM(device=DEVICE, dtype="float32", num_kv_blocks=256, **kw, **parallel)
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts((300, 77, 1000, 5, 150)), PARAMS, use_tqdm=False)
        outs += llm.generate(prompts((64,)), PARAMS, use_tqdm=False)
        seconds = time.perf_counter() - t0
        sched = llm.engine.scheduler
        per_rank = [m.prefix_queries for m in llm.engine.kv.managers] if hasattr(sched, "schedulers") else []
    finally:
        llm.close()
    return [(o.outputs[0].token_ids, [next(iter(p.values())).logprob for p in o.outputs[0].logprobs])
            for o in outs], seconds, per_rank


def main() -> int:
    if DEVICE == "cuda" and torch.cuda.device_count() < 2:
        print("needs 2 CUDA devices; FAILED")
        return 1
    report, ok = {}, True
    for name, kw in MODELS.items():
        ref, ref_s, _ = run(kw)
        got, got_s, per_rank = run(kw, expert_parallel_size=2, data_parallel_size=2)
        tokens_equal = [a[0] == b[0] for a, b in zip(ref, got)]
        diff = max(abs(x - y) for a, b in zip(ref, got) for x, y in zip(a[1], b[1]))
        spread = len(per_rank) == 2 and min(per_rank) > 0
        passed = all(tokens_equal) and diff <= TOL and spread
        ok &= passed
        report[name] = dict(tokens_equal=tokens_equal, max_logprob_diff=diff, prompt_tokens_per_rank=per_rank,
                            single_s=ref_s, dp_s=got_s, passed=passed)
        print(name, json.dumps(report[name]))
    out = Path(os.environ.get("OUT", "."))
    (out / "dp_cuda_check.json").write_text(json.dumps(report, indent=1))
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
