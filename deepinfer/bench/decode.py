"""``deepinfer bench decode``: decode steps per second at batch B and context length L.

B random prompts of L tokens are prefilled first (untimed, reported apart); once every
request has its first token, ``--warmup`` decode steps run untimed (their routing is
recorded to count the experts each layer touches), then ``--steps`` decode steps are
timed as one window. Reported, never mixed:

- full-acceptance throughput ``SPS x B x (1 + nextn) / cp`` (DeepSeek's convention);
- effective throughput: tokens actually committed in the window / its time.

With ``--speculative N`` the same point is measured again on the same engine with
speculative decoding (bench/speculative.py: N drafts a step), and reported apart: its
full-acceptance (nextn = N) and effective throughput, measured tau, per-user speed against
the run without it, a verification step's time against a plain decode step's, and the
throughput under an assumed acceptance (labelled as such).

Floor: the bytes one step must move (weights touched, with the counted distinct routed
experts, plus KV cache; bench/floors.py) / measured HBM bandwidth, at the context length
in the middle of the window.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

import torch

from deepinfer.bench.common import (CP, BenchModel, RoutingRecorder, Timer, build_engine, drain,
                                    invariant_profile_path, profile_to_file,
                                    fmt, free_memory, header, measure_floors, print_header, print_table,
                                    random_prompts, step_outputs, write_json)
from deepinfer.bench.floors import floor_ms
from deepinfer.bench.speculative import (SpecSetup, check_spec_args, counters_since, engine_settings,
                                         report_spec, spec_figures, speculation)
from deepinfer.engine.engine import Engine
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams


def check_decode_args(args: argparse.Namespace, batches: list[int]) -> None:
    if min(batches) < 1 or args.context_len < 1 or args.steps < 1 or args.hf_steps < 1 or args.warmup < 0:
        raise ValueError("batch sizes, --context-len, --steps and --hf-steps must be >= 1, --warmup >= 0")
    check_spec_args(args)


def _collect(outs: list[RequestOutput], produced: dict[str, int]) -> int:
    """Tokens committed by these outputs since the last count (``produced`` is updated)."""
    new = 0
    for out in outs:
        n = len(out.outputs[0].token_ids)
        new += n - produced[out.request_id]
        produced[out.request_id] = n
    return new


SETTLE_STEPS = 2


def decode_tokens(batch: int, context: int, budget: int, warmup: int, steps: int, spec: int = 0) -> int:
    """Output tokens each request may produce. Requests whose prefill ends early decode (one
    token a step, up to 1 + ``spec`` with speculative decoding) while the others still
    prefill, in at most ceil(B * L / (budget - B)) + 1 steps: they must not end, nor reach
    max_model_len, inside the timed window."""
    prefill_steps = -(-batch * context // max(1, budget - batch)) + 1
    steps_taken = prefill_steps + warmup + SETTLE_STEPS + 2 * steps + PROFILED_STEPS + 3   # 2x: --compare-sync
    return (1 + spec) * steps_taken


def decode_budget(args: argparse.Namespace, batch: int) -> int:
    """The engine's token budget: ``--max-num-batched-tokens``, else room for a step of
    ``batch`` requests of 1 + ``--speculative`` tokens each."""
    return args.max_num_batched_tokens or max(4096, batch * (1 + args.speculative))


def _timed_window(engine: Engine, steps: int, produced: dict[str, int]) -> tuple[float, list[int], list[float]]:
    """(seconds, tokens committed per step, ms per step) of ``steps`` engine steps."""
    committed, step_ms = [], []
    timer = Timer(engine.config.device)
    timer.start()
    for _ in range(steps):
        t0 = time.perf_counter()
        committed.append(_collect(step_outputs(engine), produced))
        step_ms.append((time.perf_counter() - t0) * 1e3)
    return timer.stop(), committed, step_ms


def _without_overlap(engine: Engine, steps: int, produced: dict[str, int]) -> dict[str, Any]:
    """The same decode with overlapped scheduling off: each step's plan waits for the last
    step's results (one transitional step first, then ``steps`` timed)."""
    engine.async_scheduling = False
    try:
        _collect(step_outputs(engine), produced)
        engine.reset_stats()
        window_s, _, _ = _timed_window(engine, steps, produced)
        stats = copy.copy(engine.stats)
    finally:
        engine.async_scheduling = engine.config.scheduler.async_scheduling
    return {"ms_per_step": window_s * 1e3 / steps, "steps": stats.steps, "overlapped_steps": stats.overlapped_steps,
            "gpu_idle_ms_per_step": stats.gpu_idle_ms_per_step, "gpu_busy_ms_per_step": stats.gpu_busy_ms_per_step}


def measure_decode(engine: Engine, batch: int, context: int, warmup: int, steps: int,
                   gen: torch.Generator, profile: str | None = None, compare_sync: bool = False) -> dict[str, Any]:
    """Prefill ``batch`` requests of ``context`` tokens, then time ``steps`` decode steps
    (and, with ``compare_sync``, as many again without overlapped scheduling)."""
    budget = engine.config.scheduler.max_num_batched_tokens
    nextn = engine.scheduler.num_speculative_tokens
    params = SamplingParams(temperature=0.0, max_tokens=decode_tokens(batch, context, budget, warmup, steps, nextn),
                            ignore_eos=True)
    timer = Timer(engine.config.device)
    prompts = random_prompts(batch, context, engine.config.model.vocab_size, gen)
    timer.start()
    rids = [engine.add_request(p, params) for p in prompts]
    produced = dict.fromkeys(rids, 0)
    prefill_steps = 0
    while min(produced.values()) < 1:
        _collect(step_outputs(engine), produced)
        prefill_steps += 1
    prefill_s = timer.stop()

    # The routers' hooks do not see CUDA-graph replays: the warm-up steps run eagerly, so the
    # floor counts the experts this routing really touches rather than an estimate.
    graphs, engine.runner.decode_graphs = engine.runner.decode_graphs, None
    recorder = RoutingRecorder(engine.model)
    try:
        for _ in range(warmup):
            _collect(step_outputs(engine), produced)
    finally:
        recorder.remove()
        engine.runner.decode_graphs = graphs
    # Steps with graphs before the window: the last eager warm-up step lands (and its device
    # time would count) in the first step of the window otherwise.
    for _ in range(SETTLE_STEPS):
        _collect(step_outputs(engine), produced)

    engine.reset_stats()
    spec_before = copy.deepcopy(engine.scheduler.spec_stats)
    graph_verifications_before = engine.runner.verify_graph_steps
    drafter_graphs_before = engine.runner.drafter_graph_steps
    draft_graphs = engine.runner.draft_graphs
    proposals_before = draft_graphs.steps if draft_graphs is not None else 0
    window_s, committed, step_ms = _timed_window(engine, steps, produced)
    stats = copy.copy(engine.stats)   # the engine keeps counting through the profile and drain
    spec_counters = counters_since(spec_before, engine.scheduler.spec_stats)
    spec_counters["graph_verifications"] = engine.runner.verify_graph_steps - graph_verifications_before
    # A model drafter's steps whose forward replayed a decode graph, and proposals on DraftGraphs.
    spec_counters["drafter_graph_steps"] = engine.runner.drafter_graph_steps - drafter_graphs_before
    spec_counters["draft_graph_proposals"] = (draft_graphs.steps if draft_graphs is not None else 0) - proposals_before
    without = (_without_overlap(engine, steps, produced)
               if compare_sync and engine.config.scheduler.async_scheduling else None)
    if profile:
        profile_steps(engine, profile, produced)
    drain(engine, rids)

    if min(committed) < batch:
        print(f"warning: B={batch}: a timed step committed only {min(committed)} tokens (sequences ended or "
              "were preempted inside the window); the step time is not that of a full batch", file=sys.stderr)
    sps = steps / window_s
    effective = sum(committed) / window_s
    return {
        "ms_per_step": 1e3 / sps, "steps_per_s": sps,
        "full_acceptance_tok_s": sps * batch * (1 + nextn) / CP,
        "effective_tok_s": effective, "effective_tok_s_per_gpu": effective,
        "per_user_tok_s": effective / batch,
        "step_ms_median": statistics.median(step_ms), "step_ms_max": max(step_ms),
        "tokens_committed": sum(committed), "min_tokens_per_step": min(committed),
        "prefill_s": prefill_s, "prefill_steps": prefill_steps,
        "async_scheduling": engine.config.scheduler.async_scheduling,
        "cuda_graphs": engine.runner.decode_graphs is not None,
        "overlapped_steps": stats.overlapped_steps, "sync_steps": stats.sync_steps,
        "gpu_idle_ms_per_step": stats.gpu_idle_ms_per_step, "gpu_busy_ms_per_step": stats.gpu_busy_ms_per_step,
        "without_overlap": without,
        "spec_counters": spec_counters,     # all 0 without speculative decoding
        "distinct_experts_counted": recorder.distinct_per_layer(),
    }


PROFILED_STEPS = 4


def profile_steps(engine: Engine, path: str, produced: dict[str, int]) -> None:
    """Run PROFILED_STEPS decode steps under torch.profiler; write the device kernels by
    total time (with their launch counts per step) to ``path``."""
    profile_to_file(path, f"{PROFILED_STEPS} decode steps", PROFILED_STEPS,
                    lambda: [_collect(step_outputs(engine), produced) for _ in range(PROFILED_STEPS)])


def decode_point(engine: Engine, model: BenchModel, measured: dict[str, float], batch: int, context: int,
                 warmup: int, steps: int, gen: torch.Generator, profile: str | None = None,
                 compare_sync: bool = False, spec: SpecSetup | None = None) -> dict[str, Any]:
    """One (batch, context) measurement with its floor; with ``spec``, the same again with
    speculative decoding (under ``"spec"``; the floor is the plain decode step's)."""
    with speculation(engine, None):
        eng = measure_decode(engine, batch, context, warmup, steps, gen, profile, compare_sync)
    counted = eng.pop("distinct_experts_counted")
    mid = context + warmup + (steps + 1) // 2       # tokens per sequence after the window's middle step
    work = model.cost.decode_step(batch, mid, counted)
    floor = {**work, **floor_ms(work, measured["hbm_gb_s"], measured["matmul_tflop_s"]),
             "context_at": mid, "distinct_experts_source": "counted" if counted else "estimate",
             "distinct_experts_estimate": model.cost.estimated_distinct_experts(batch)[0]}
    spec_point = None
    if spec is not None:
        with speculation(engine, spec.drafter):
            run = measure_decode(engine, batch, context, warmup, steps, gen)
        spec_point = spec_figures(run, eng, batch, steps, spec)
    return {"batch": batch, "context_len": context, "engine": eng, "floor": floor,
            "engine_over_floor": eng["ms_per_step"] / floor["floor_ms"], "hf": None, "spec": spec_point}


def add_hf(points: list[dict[str, Any]], model: BenchModel, args: argparse.Namespace,
           gen: torch.Generator) -> None:
    """The HF baseline at each point's batch and context (the engine must be freed first)."""
    from deepinfer.bench.hf_baseline import HFBaseline, hf_skip_reason

    skip = hf_skip_reason(model.hf_config)
    if skip:
        for point in points:
            point["hf"] = {"skipped": skip}
        return
    hf = HFBaseline(model.hf_config, model.dtype, model.device, args.seed)
    try:
        for point in points:
            point["hf"] = hf.decode(point["batch"], point["context_len"], args.hf_steps, gen)
            if point["hf"].get("ms_per_step"):
                point["engine_speedup_over_hf"] = point["hf"]["ms_per_step"] / point["engine"]["ms_per_step"]
    finally:
        hf.close()


def run_decode(args: argparse.Namespace) -> dict[str, Any]:
    model = BenchModel.from_args(args)
    check_decode_args(args, [args.batch_size])
    budget = decode_budget(args, args.batch_size)
    max_model_len = args.context_len + decode_tokens(args.batch_size, args.context_len, budget, args.warmup,
                                                     args.steps, args.speculative)
    fit = model.check_fits(args.batch_size * max_model_len)
    result = header("decode", model, measure_floors(model, args), args.argv)
    result.update(warmup_steps=args.warmup, timed_steps=args.steps, max_num_batched_tokens=budget, memory=fit)
    engine = build_engine(model, args, max_num_seqs=args.batch_size, max_num_batched_tokens=budget,
                          max_model_len=max_model_len, **engine_settings(args))
    result["weights_in_memory"] = engine.model.weight_bytes
    spec = SpecSetup.from_args(args, engine)
    result["speculative"] = spec.describe() if spec else None
    gen = torch.Generator().manual_seed(args.seed)
    point = decode_point(engine, model, result["measured"], args.batch_size, args.context_len, args.warmup,
                         args.steps, gen, args.profile, args.compare_sync, spec)
    del engine
    free_memory(model.device)
    if args.batch_invariant:
        # The same engine settings in batch-invariant mode, on the same prompts (same seed).
        engine = build_engine(model, args, max_num_seqs=args.batch_size, max_num_batched_tokens=budget,
                              max_model_len=max_model_len, batch_invariant=True)
        invariant = measure_decode(engine, args.batch_size, args.context_len, args.warmup, args.steps,
                                   torch.Generator().manual_seed(args.seed), invariant_profile_path(args.profile))
        del engine
        free_memory(model.device)
        result["batch_invariant"] = {"ms_per_step": invariant["ms_per_step"],
                                     "slowdown": invariant["ms_per_step"] / point["engine"]["ms_per_step"]}
    if not args.no_hf:
        add_hf([point], model, args, gen)
    result.update(point)
    report(result, [point])
    if args.batch_invariant:
        bi = result["batch_invariant"]
        print(f"batch-invariant mode: {bi['ms_per_step']:.4g} ms/step, {bi['slowdown']:.3g}x the normal mode's "
              f"{point['engine']['ms_per_step']:.4g} ms/step (same run)")
    write_json(args.output_json, result)
    return result


def report(result: dict[str, Any], points: list[dict[str, Any]]) -> None:
    print_header(result)
    rows = []
    for p in points:
        e, f, hf = p["engine"], p["floor"], p["hf"] or {}
        rows.append([f"B={p['batch']}", p["context_len"], e["ms_per_step"], f["floor_ms"], p["engine_over_floor"],
                     e["full_acceptance_tok_s"], e["effective_tok_s"], e["per_user_tok_s"],
                     hf.get("ms_per_step"), hf.get("context_len"), p.get("engine_speedup_over_hf")])
    print_table(f"decode ({result['timed_steps']} timed steps after {result['warmup_steps']} warm-up; "
                f"no speculative decoding: nextn={result['nextn']}, cp={result['cp']})",
                ["", "context", "ms/step", "floor ms", "x floor", "tok/s full", "tok/s eff.", "tok/s/user",
                 "HF ms/step", "HF ctx", "vs HF"], rows)
    for p in points:
        f = p["floor"]
        experts = ", ".join(f"{x:.1f}" for x in f["distinct_experts"])
        print(f"B={p['batch']}: floor {f['bytes'] / 1e9:.3g} GB ({f['weight_bytes'] / 1e9:.3g} weights + "
              f"{f['kv_bytes'] / 1e9:.3g} KV) -> {f['bytes_ms']:.3g} ms; {f['flops'] / 1e12:.3g} TFLOP -> "
              f"{f['flops_ms']:.3g} ms; distinct experts/layer [{experts}] ({f['distinct_experts_source']}; "
              f"uniform estimate {f['distinct_experts_estimate']:.1f})")
        e = p["engine"]
        print(f"B={p['batch']}: CUDA graphs {'on' if e['cuda_graphs'] else 'off'}, overlapped scheduling "
              f"{'on' if e['async_scheduling'] else 'off'} ({e['overlapped_steps']} overlapped, "
              f"{e['sync_steps']} synchronous steps); GPU busy {fmt(e['gpu_busy_ms_per_step'])} ms/step, "
              f"idle between steps {fmt(e['gpu_idle_ms_per_step'])} ms/step")
        w = e.get("without_overlap")
        if w:
            print(f"B={p['batch']}: without overlapped scheduling: {fmt(w['ms_per_step'])} ms/step, GPU busy "
                  f"{fmt(w['gpu_busy_ms_per_step'])} ms/step, idle between steps "
                  f"{fmt(w['gpu_idle_ms_per_step'])} ms/step")
        if p["hf"] and "skipped" in p["hf"]:
            print(f"B={p['batch']}: HF transformers skipped ({p['hf']['skipped']})")
    if result.get("speculative"):
        report_spec(result["speculative"], points)
