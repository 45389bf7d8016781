"""Device timeline of steady prefill steps: where the time between the first and the
last kernel of a step goes, kernel by kernel, and how much of it the device sat idle.

``bench prefill``'s steady window reports device busy per step from two events around the
forward; the profiler's per-kernel table sums kernel durations. This probe puts the two side
by side for the same steps: it queues prompts like the steady window, profiles two steps
once the engine is warm, and writes every kernel (name, grid, start, duration, gap before it)
to a TSV, then prints the gaps that matter and each kernel name's calls.

    PYTHONPATH=. python3 scripts/probes/prefill_timeline.py --config deepseek-v4-flash \
        --prompt-len 4096 --no-hf [--tsv $OUT/timeline.tsv]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from deepinfer.bench.args import add_prefill_args
from deepinfer.bench.common import BenchModel, build_engine, random_prompts, step_outputs
from deepinfer.bench.prefill import measure_prefill
from deepinfer.sampling_params import SamplingParams

_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def steady_trace(engine, prompt_len: int, warm_steps: int, traced_steps: int, gen) -> list[dict]:
    """Queue prompts, step until ``warm_steps`` have finished, then profile ``traced_steps`` more."""
    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for p in random_prompts(warm_steps + traced_steps + 1, prompt_len, vocab, gen):
        engine.add_request(p, params)
    finished = 0
    while finished < warm_steps:
        finished += sum(o.finished for o in step_outputs(engine))
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        while finished < warm_steps + traced_steps:
            finished += sum(o.finished for o in step_outputs(engine))
        torch.cuda.synchronize()
    while engine.has_unfinished():
        step_outputs(engine)
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return events


def main() -> None:
    p = argparse.ArgumentParser()
    add_prefill_args(p)
    p.add_argument("--tsv", default=None, help="write every device op of the traced steps here")
    p.add_argument("--top", type=int, default=25, help="largest gaps to print")
    args = p.parse_args()
    args.argv = []
    model = BenchModel.from_args(args)
    engine = build_engine(model, args, max_num_seqs=2, max_num_batched_tokens=args.prompt_len,
                          max_model_len=args.prompt_len + 1)
    gen = torch.Generator().manual_seed(args.seed)
    measure_prefill(engine, 1, args.prompt_len, 2, 1, gen)             # compile and warm
    events = steady_trace(engine, args.prompt_len, 2, 2, gen)

    ops = sorted((e for e in events if e.get("cat") in _DEVICE_CATS and e.get("ph") == "X"),
                 key=lambda e: e["ts"])
    forwards = sorted((e for e in events if e.get("cat") == "gpu_user_annotation"
                       and e.get("name") == "deepinfer.forward"), key=lambda e: e["ts"])
    print(f"{len(ops)} device ops; forward ranges on the device (us): "
          + ", ".join(f"{f['dur']:.0f}" for f in forwards))
    rows, gaps = [], []
    prev_end, prev_name = None, ""
    for e in ops:
        gap = e["ts"] - prev_end if prev_end is not None else 0.0
        grid = e.get("args", {}).get("grid", "")
        rows.append((e["name"][:60], str(grid), e["ts"], e["dur"], gap))
        if prev_end is not None:
            gaps.append((gap, prev_name, e["name"][:60]))
        prev_end, prev_name = e["ts"] + e["dur"], e["name"][:60]
    span = ops[-1]["ts"] + ops[-1]["dur"] - ops[0]["ts"]
    busy = sum(e["dur"] for e in ops)
    print(f"span {span / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms, gaps {(span - busy) / 1e3:.3f} ms "
          f"over {len(ops) - 1} boundaries (mean {(span - busy) / max(1, len(ops) - 1):.2f} us)")
    small = sum(g for g, _, _ in gaps if g < 20)
    print(f"gaps under 20 us sum to {small / 1e3:.3f} ms; the {args.top} largest:")
    for g, a, b in sorted(gaps, reverse=True)[:args.top]:
        print(f"  {g:9.1f} us  {a}  ->  {b}")
    by_name: dict[str, list[tuple[float, str]]] = collections.defaultdict(list)
    for name, grid, _, dur, _ in rows:
        by_name[name].append((dur, grid))
    print("\nper kernel name: calls, total us, per call (grid)")
    for name, calls in sorted(by_name.items(), key=lambda kv: -sum(d for d, _ in kv[1])):
        total = sum(d for d, _ in calls)
        if total < 20:
            continue
        detail = ", ".join(f"{d:.0f}{g}" for d, g in calls[:12])
        print(f"  {name[:48]:48s} {len(calls):4d} {total:9.0f}  {detail}")
    if args.tsv:
        with open(args.tsv, "w") as f:
            f.write("name\tgrid\tts_us\tdur_us\tgap_us\n")
            for r in rows:
                f.write("\t".join(str(x) for x in r) + "\n")


if __name__ == "__main__":
    main()
