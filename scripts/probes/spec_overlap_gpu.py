"""Overlapped speculative steps on one device: the embedded model with its DSpark drafter,
overlapped scheduling on and off, greedy at B = 1 and 16. Reports whether the outputs are
equal, how many steps overlapped or were synchronous, the device's idle time per step and
the decode rate. Writes spec_overlap.json to $OUT (default ./out).

    python3 scripts/probes/spec_overlap_gpu.py            # CUDA
    python3 scripts/probes/spec_overlap_gpu.py --device cpu --max-tokens 16 --batch-sizes 1,2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "The list type is",
    "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n",
    "def fib(n):",
    "Return a new dictionary with keys from iterable and values set to value.",
]


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], dict]:
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)   # warm-up
    llm.engine.reset_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    st = llm.engine.stats
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return tokens, dict(steps=st.steps, overlapped_steps=st.overlapped_steps, sync_steps=st.sync_steps,
                        gpu_idle_ms_per_step=st.gpu_idle_ms_per_step, gpu_busy_ms_per_step=st.gpu_busy_ms_per_step,
                        wall_s=wall, tokens_per_s=sum(map(len, tokens)) / wall)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batch-sizes", default="1,16")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    report = {}
    engines = {a: LLM(device=args.device, async_scheduling=a,
                      speculative_config={"method": "dspark", "num_speculative_tokens": 3}) for a in (True, False)}
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(b)]
        row = {}
        tokens = {}
        for a, llm in engines.items():
            tokens[a], row["overlapped" if a else "synchronous"] = run(llm, prompts, params)
        row["outputs_equal"] = tokens[True] == tokens[False]
        report[f"B={b}"] = row
        print(f"B={b}", json.dumps(row, indent=1), flush=True)
    (out_dir / "spec_overlap.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
