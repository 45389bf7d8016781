"""``deepinfer bench prefill``: input tokens per second per GPU.

Two figures, both over random prompts of ``prompt_len`` tokens with ``max_tokens=1`` (a
request ends when its prefill samples a token):

* round (latency of a batch that arrives alone): one round adds ``batch`` prompts and steps
  the engine until all finish; the first ``--warmup`` rounds are discarded (they compile
  kernels and warm allocators), the figure is ``batch x prompt_len / mean round time`` over
  the next ``--iters`` rounds. The engine is idle between rounds, so the host work before the
  first launch and after the last sync counts.
* steady (throughput under load, DESIGN.md's definition): ``(warmup + iters + 1) x batch``
  prompts are queued at once and the engine prefills ``batch`` of them a step (the token
  budget); the figure is the input tokens of the ``iters`` steps after the warm-up ones over
  the time between their completions (a last batch queued behind them keeps the window's
  end as late as its start: ``measure_steady``), so overlapped scheduling hides the host
  work as it would in a serving engine, as far as the host keeps ahead of the device.

With ``--cp N`` each prompt is split over N context-parallel ranks (one device each): the
per-GPU figures (tokens/s per GPU, the engine's time against one device's floor, matmul
shares) count the time on all N devices.

Floor: the prefill's useful FLOPs / measured matmul rate (or its bytes / measured bandwidth,
whichever is larger; bench/floors.py). Beside it, for DeepSeek-V4, a per-part floor: the
routed experts (memory bound at a few dozen rows per expert) and the rest (compute bound),
each at its own bound, summed (``floors.parts_floor_ms``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch

from deepinfer.bench.common import (BenchModel, Timer, build_engine, free_memory, header, invariant_profile_path,
                                    measure_floors, print_header, print_table, profile_to_file, random_prompts,
                                    step_outputs, sync, write_json)
from deepinfer.bench.floors import floor_ms, measure_matmul_tflops, parts_floor_ms
from deepinfer.engine.engine import Engine
from deepinfer.sampling_params import SamplingParams


def measure_prefill(engine: Engine, batch: int, prompt_len: int, warmup: int, iters: int,
                    gen: torch.Generator) -> dict[str, Any]:
    gpus = engine.config.parallel.cp
    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    timer = Timer(engine.config.device)
    rounds, steps, gpu_ms = [], [], []
    for i in range(warmup + iters):
        prompts = random_prompts(batch, prompt_len, vocab, gen)
        engine.reset_stats()
        timer.start()
        pending = {engine.add_request(p, params) for p in prompts}
        launched = engine.stats.steps
        while pending:
            for out in step_outputs(engine):
                if out.finished:
                    pending.discard(out.request_id)
        elapsed = timer.stop()
        # Model steps, not step() calls: with overlapped scheduling outputs trail by one call.
        n_steps = engine.stats.steps - launched
        if i >= warmup:
            rounds.append(elapsed)
            steps.append(n_steps)
            gpu_ms.append(engine.stats.gpu_step_ms)
    mean_s = statistics.fmean(rounds)
    # CUDA: the device time of the round's steps (start to end event of each); the rest of the
    # round is host work the device waited for (scheduling, input preparation, launches).
    gpu = statistics.fmean(gpu_ms) if engine.config.device.type == "cuda" else None
    return {"round_ms": [t * 1e3 for t in rounds], "ms": mean_s * 1e3, "steps_per_round": steps,
            "gpu_ms": gpu,
            "input_tok_s": batch * prompt_len / mean_s, "input_tok_s_per_gpu": batch * prompt_len / mean_s / gpus}


def measure_steady(engine: Engine, batch: int, prompt_len: int, warmup: int, iters: int,
                   gen: torch.Generator) -> dict[str, Any]:
    """Queue ``(warmup + iters + 1) x batch`` prompts at once and time the ``iters`` steps of
    ``batch`` prompts after the warm-up ones: from the completion of the last warm-up prompt
    to that of the last timed one (host clock: when each output reaches the host).

    One more batch stays queued behind the window, so that its last completion is seen as
    late as its first: with overlapped scheduling a step() launches the next step before it
    lands the previous one, so an output reaches the host only once the next step is
    launched. Where that launch takes about as long as a step on the device, a window whose
    last step has nothing queued behind it ends early by up to that launch time (this
    overstated throughput by ~8% on the H200 at T=4096 before the extra batch)."""
    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = random_prompts((warmup + iters + 1) * batch, prompt_len, vocab, gen)
    order = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    finished = 0
    start_at = warmup * batch            # prompts finished when the window opens (0: at once)
    end_at = (warmup + iters) * batch    # ... when it closes
    sync(engine.config.device)
    t0 = t1 = time.perf_counter()
    engine.reset_stats()
    stats = engine.stats
    while finished < len(prompts):
        for out in step_outputs(engine):
            if out.finished and order.pop(out.request_id, None) is not None:
                finished += 1
                if finished == start_at:
                    t0 = time.perf_counter()
                    engine.reset_stats()
                if finished == end_at:
                    t1 = time.perf_counter()
                    stats = dataclasses.replace(engine.stats)       # the window's, not the tail's
    sync(engine.config.device)
    elapsed = t1 - t0
    tokens = iters * batch * prompt_len
    cuda = engine.config.device.type == "cuda"
    # ms: per batch of prompts (one engine step unless the budget chunks the prompts).
    return {"ms": elapsed * 1e3 / iters, "input_tok_s_per_gpu": tokens / elapsed / engine.config.parallel.cp,
            "steps": stats.steps, "overlapped_steps": stats.overlapped_steps,
            "gpu_busy_ms_per_step": stats.gpu_busy_ms_per_step if cuda else None,
            "gpu_idle_ms_per_step": stats.gpu_idle_ms_per_step if cuda else None}


def run_prefill(args: argparse.Namespace) -> dict[str, Any]:
    model = BenchModel.from_args(args)
    if min(args.prompt_len, args.batch_size, args.iters) < 1 or args.warmup < 0:
        raise ValueError("--prompt-len, --batch-size and --iters must be >= 1 and --warmup >= 0")
    cp = getattr(args, "cp", 1)
    if cp < 1:
        raise ValueError(f"--cp {cp} must be >= 1")
    # Twice the batch may be in the engine at once (below).
    fit = model.check_fits(2 * args.batch_size * (args.prompt_len + 1))
    result = header("prefill", model, measure_floors(model, args), args.argv, cp=cp)
    result["memory"] = fit
    # Whole prompts per step, up to 4096 tokens: the engine sizes its KV cache after a profiling
    # forward of this many tokens as one sequence, whose attention scores grow with its square.
    budget = args.max_num_batched_tokens or min(args.batch_size * args.prompt_len, max(args.prompt_len, 4096))
    result.update(batch=args.batch_size, prompt_len=args.prompt_len, warmup_rounds=args.warmup,
                  timed_rounds=args.iters, max_num_batched_tokens=budget)

    # Twice the batch: under steady load the next batch is admitted while the last is in flight.
    engine = build_engine(model, args, max_num_seqs=2 * args.batch_size, max_num_batched_tokens=budget,
                          max_model_len=args.prompt_len + 1, context_parallel_size=cp)
    result["weights_in_memory"] = None if engine.model is None else engine.model.weight_bytes
    gen = torch.Generator().manual_seed(args.seed)
    result["engine"] = measure_prefill(engine, args.batch_size, args.prompt_len, args.warmup, args.iters, gen)
    result["engine"]["steady"] = measure_steady(engine, args.batch_size, args.prompt_len, args.warmup,
                                                args.iters, gen)
    # The matmul rate again, right after the window: the GPU's clocks under sustained load,
    # beside the rested rate the headline share is taken against.
    result["measured"]["matmul_tflop_s_after"] = measure_matmul_tflops(model.device, args.floor_matmul_n,
                                                                       model.dtype)
    if args.profile:
        profile_to_file(args.profile, "1 prefill round", 1,
                        lambda: measure_prefill(engine, args.batch_size, args.prompt_len, 0, 1, gen))
    del engine
    free_memory(model.device)
    if args.batch_invariant:
        # The same engine settings in batch-invariant mode, on the same prompts (same seed).
        engine = build_engine(model, args, max_num_seqs=2 * args.batch_size, max_num_batched_tokens=budget,
                              max_model_len=args.prompt_len + 1, batch_invariant=True, context_parallel_size=cp)
        invariant_gen = torch.Generator().manual_seed(args.seed)
        invariant = measure_prefill(engine, args.batch_size, args.prompt_len, args.warmup, args.iters,
                                    invariant_gen)
        if args.profile:
            profile_to_file(invariant_profile_path(args.profile), "1 prefill round", 1,
                            lambda: measure_prefill(engine, args.batch_size, args.prompt_len, 0, 1, invariant_gen))
        del engine
        free_memory(model.device)
        result["batch_invariant"] = {"ms": invariant["ms"], "slowdown": invariant["ms"] / result["engine"]["ms"]}

    work = model.cost.prefill(args.batch_size, args.prompt_len)
    floor = {**work, **floor_ms(work, result["measured"]["hbm_gb_s"], result["measured"]["matmul_tflop_s"])}
    result["floor"] = floor
    # Against one device's floor, the engine's time counts on each of its cp devices.
    result["engine_over_floor"] = result["engine"]["ms"] * cp / floor["floor_ms"]
    if "expert_bytes" in work:
        parts = parts_floor_ms(work, result["measured"]["hbm_gb_s"], result["measured"]["matmul_tflop_s"])
        result["parts_floor"] = parts
        result["steady_over_parts_floor"] = result["engine"]["steady"]["ms"] * cp / parts["floor_ms"]
    peak = result["measured"]["matmul_tflop_s"] * 1e12
    result["matmul_peak_share"] = work["flops"] / (result["engine"]["ms"] * 1e-3 * cp) / peak
    result["steady_matmul_peak_share"] = work["flops"] / (result["engine"]["steady"]["ms"] * 1e-3 * cp) / peak
    result["steady_matmul_after_share"] = (work["flops"] / (result["engine"]["steady"]["ms"] * 1e-3 * cp)
                                           / (result["measured"]["matmul_tflop_s_after"] * 1e12))

    result["hf"] = None
    if not args.no_hf:
        from deepinfer.bench.hf_baseline import HFBaseline, hf_skip_reason

        skip = hf_skip_reason(model.hf_config)
        if skip:
            result["hf"] = {"skipped": skip}
        else:
            hf = HFBaseline(model.hf_config, model.dtype, model.device, args.seed)
            try:
                result["hf"] = hf.prefill(args.batch_size, args.prompt_len, args.hf_iters, gen)
            finally:
                hf.close()
    report(result)
    if args.batch_invariant:
        bi = result["batch_invariant"]
        print(f"batch-invariant mode: {bi['ms']:.4g} ms per batch of prompts, {bi['slowdown']:.3g}x the normal "
              f"mode's {result['engine']['ms']:.4g} ms (same run)")
    write_json(args.output_json, result)
    return result


def steady_device_ms(steady: dict[str, Any], steps_per_batch: float) -> float | None:
    """The device timeline of one steady batch (busy + idle per step x steps a batch), which
    should match the window's ``ms``; None off CUDA. A gap between the two means the window
    does not cover the steps it counts."""
    if steady.get("gpu_busy_ms_per_step") is None:
        return None
    return (steady["gpu_busy_ms_per_step"] + steady["gpu_idle_ms_per_step"]) * steps_per_batch


def report(result: dict[str, Any]) -> None:
    print_header(result)
    e, f, hf = result["engine"], result["floor"], result["hf"]
    st = e["steady"]
    rows = [["engine, round", result["prompt_len"], e["ms"], e["input_tok_s_per_gpu"], result["engine_over_floor"]],
            ["engine, steady", result["prompt_len"], st["ms"], st["input_tok_s_per_gpu"],
             st["ms"] * result["cp"] / f["floor_ms"]],
            ["floor", result["prompt_len"], f["floor_ms"],
             result["batch"] * result["prompt_len"] / (f["floor_ms"] * 1e-3), 1.0]]
    if hf and "ms" in hf:
        rows.append(["HF transformers", hf["prompt_len"], hf["ms"], hf["input_tok_s"],
                     hf["ms"] / f["floor_ms"] if hf["prompt_len"] == result["prompt_len"] else None])
    print_table(f"prefill, batch {result['batch']} x {result['prompt_len']} tokens "
                f"({result['timed_rounds']} rounds after {result['warmup_rounds']} warm-up)",
                ["", "prompt", "ms", "input tok/s/GPU", "x floor"], rows)
    if e.get("gpu_ms") is not None:
        print(f"engine: device busy {e['gpu_ms']:.3g} ms of the {e['ms']:.3g} ms round (the rest: host work "
              "before and between launches)")
    if st.get("gpu_busy_ms_per_step") is not None:
        print(f"steady: {st['overlapped_steps']}/{st['steps']} steps overlapped; device busy "
              f"{st['gpu_busy_ms_per_step']:.3g} ms/step, idle between steps {st['gpu_idle_ms_per_step']:.3g} ms/step")
        device = steady_device_ms(st, statistics.fmean(e["steps_per_round"]))
        if abs(device - st["ms"]) > 0.05 * st["ms"]:
            print(f"WARNING: the steady window ({st['ms']:.3g} ms a batch) and the device timeline of its "
                  f"steps ({device:.3g} ms) differ by more than 5%: the window figure is suspect")
    print(f"floor: {f['flops'] / 1e12:.3g} TFLOP -> {f['flops_ms']:.3g} ms; {f['bytes'] / 1e9:.3g} GB -> "
          f"{f['bytes_ms']:.3g} ms ({f['bound']}-bound); engine at "
          f"{100 * result['matmul_peak_share']:.1f}% of the measured matmul rate per round, "
          f"{100 * result['steady_matmul_peak_share']:.1f}% steady")
    m = result["measured"]
    print(f"matmul rate right after the steady window: {m['matmul_tflop_s_after']:.4g} TFLOP/s "
          f"({100 * m['matmul_tflop_s_after'] / m['matmul_tflop_s']:.1f}% of the rate before it); engine steady at "
          f"{100 * result['steady_matmul_after_share']:.1f}% of it")
    parts = result.get("parts_floor")
    if parts:
        ex, rest = parts["experts"], parts["rest"]
        print(f"per-part floor: routed experts {ex['floor_ms']:.3g} ms ({ex['bound']}-bound) + the rest "
              f"{rest['floor_ms']:.3g} ms ({rest['bound']}-bound) = {parts['floor_ms']:.3g} ms; engine steady at "
              f"{result['steady_over_parts_floor']:.2f}x of it")
    if hf and "skipped" in hf:
        print(f"HF transformers: skipped ({hf['skipped']})")
