"""``deepinfer bench curve``: decode over batch sizes (1, 2, 4, ..., 256 by default).

Each batch size is one ``bench decode`` measurement (bench/decode.py) on the same
engine; the curve is effective throughput per GPU against per-user tokens/s, with
the floor at each batch (the fastest any engine could go: ``B / floor`` and
``1 / floor``) and HF transformers where it fits. The JSON is always written; the PNG
needs matplotlib (the ``bench`` extra) and is skipped with a message without it.

With ``--speculative N`` each point is also measured with speculative decoding
(bench/speculative.py); the curve then gets, each under its own keys and label, the
speculative run's full-acceptance (``SPS x B x (1 + N) / cp``) and effective throughput,
and the throughput under an assumed acceptance (None where the run cannot give it).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from deepinfer.bench.common import BenchModel, build_engine, free_memory, header, measure_floors, write_json
from deepinfer.bench.decode import (add_hf, check_decode_args, decode_budget, decode_point, decode_tokens,
                                    measure_decode, report)
from deepinfer.bench.speculative import SpecSetup, engine_settings, speculation
from deepinfer.engine.engine import Engine


def parse_batches(text: str) -> list[int]:
    try:
        batches = sorted({int(b) for b in text.split(",") if b.strip()})
    except ValueError:
        raise ValueError(f"--batch-sizes={text!r} must be comma-separated integers") from None
    if not batches:
        raise ValueError("--batch-sizes is empty")
    return batches


def run_curve(args: argparse.Namespace) -> dict[str, Any]:
    model = BenchModel.from_args(args)
    batches = parse_batches(args.batch_sizes)
    check_decode_args(args, batches)
    budget = decode_budget(args, batches[-1])
    max_model_len = args.context_len + decode_tokens(batches[-1], args.context_len, budget, args.warmup, args.steps,
                                                     args.speculative)
    fit = model.check_fits(batches[-1] * max_model_len)
    result = header("curve", model, measure_floors(model, args), args.argv)
    result.update(warmup_steps=args.warmup, timed_steps=args.steps, context_len=args.context_len,
                  max_num_batched_tokens=budget, memory=fit)
    engine = build_engine(model, args, max_num_seqs=batches[-1], max_num_batched_tokens=budget,
                          max_model_len=max_model_len, **engine_settings(args))
    result["weights_in_memory"] = engine.model.weight_bytes
    spec = SpecSetup.from_args(args, engine)
    result["speculative"] = spec.describe() if spec else None
    gen = torch.Generator().manual_seed(args.seed)
    warm_up(engine, batches[0], args)
    points = []
    for b in batches:
        points.append(decode_point(engine, model, result["measured"], b, args.context_len, args.warmup,
                                   args.steps, gen, spec=spec))
        s = points[-1]["spec"]
        print(f"B={b}: {points[-1]['engine']['ms_per_step']:.3f} ms/step"
              + (f", {s['ms_per_step']:.3f} ms/step speculative" if s else ""), flush=True)
    del engine
    free_memory(model.device)
    if args.batch_invariant:
        # The same engine settings in batch-invariant mode, each point on the same prompts (same seed).
        engine = build_engine(model, args, max_num_seqs=batches[-1], max_num_batched_tokens=budget,
                              max_model_len=max_model_len, batch_invariant=True)
        invariant_gen = torch.Generator().manual_seed(args.seed)
        warm_up(engine, batches[0], args)
        for p in points:
            ms = measure_decode(engine, p["batch"], args.context_len, args.warmup, args.steps,
                                invariant_gen)["ms_per_step"]
            p["batch_invariant"] = {"ms_per_step": ms, "slowdown": ms / p["engine"]["ms_per_step"]}
            print(f"B={p['batch']}: batch-invariant mode {ms:.3f} ms/step, {p['batch_invariant']['slowdown']:.3g}x "
                  f"the normal mode's {p['engine']['ms_per_step']:.3f}", flush=True)
        del engine
        free_memory(model.device)
    if not args.no_hf:
        add_hf(points, model, args, gen)
    result["points"] = points
    result["curve"] = {
        "batch": batches,
        "tok_s_per_gpu": [p["engine"]["effective_tok_s_per_gpu"] for p in points],
        "tok_s_per_user": [p["engine"]["per_user_tok_s"] for p in points],
        "floor_tok_s_per_gpu": [p["batch"] * 1e3 / p["floor"]["floor_ms"] for p in points],
        "floor_tok_s_per_user": [1e3 / p["floor"]["floor_ms"] for p in points],
        "hf_tok_s_per_gpu": [(p["hf"] or {}).get("tok_s") for p in points],
        "hf_tok_s_per_user": [1e3 / p["hf"]["ms_per_step"] if (p["hf"] or {}).get("ms_per_step") else None
                              for p in points],
    }
    if spec:
        specs = [p["spec"] for p in points]
        result["curve"].update({
            "spec_full_acceptance_tok_s_per_gpu": [s["full_acceptance_tok_s"] for s in specs],
            "spec_full_acceptance_tok_s_per_user": [s["full_acceptance_tok_s_per_user"] for s in specs],
            "spec_effective_tok_s_per_gpu": [s["effective_tok_s"] for s in specs],
            "spec_effective_tok_s_per_user": [s["per_user_tok_s"] for s in specs],
            "assumed_tok_s_per_gpu": [s["assumed"]["tok_s_per_gpu"] for s in specs],
            "assumed_tok_s_per_user": [s["assumed"]["tok_s_per_user"] for s in specs],
        })
    report(result, points)
    write_json(args.output_json, result)
    png = args.output_png or (str(Path(args.output_json).with_suffix(".png")) if args.output_json else None)
    if png:
        plot(result, png)
    return result


def plot(result: dict[str, Any], path: str) -> bool:
    """Write the curve to ``path``; False (with a message) when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"not writing {path}: the plot needs matplotlib (pip install 'deepinfer[bench]')")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = result["curve"]
    fig, ax = plt.subplots(figsize=(7, 5))
    spec = result.get("speculative")
    ax.plot(c["tok_s_per_user"], c["tok_s_per_gpu"], "o-",
            label="deepinfer" + (", no speculative decoding" if spec else ""))
    for b, x, y in zip(c["batch"], c["tok_s_per_user"], c["tok_s_per_gpu"]):
        ax.annotate(f"B={b}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.plot(c["floor_tok_s_per_user"], c["floor_tok_s_per_gpu"], "k--", label="floor (bytes / bandwidth, FLOPs / matmul rate)")
    hf = [(x, y) for x, y in zip(c["hf_tok_s_per_user"], c["hf_tok_s_per_gpu"]) if x and y]
    if hf:
        ax.plot(*zip(*hf), "s-", label="HF transformers generate")
    if spec:
        n, a, acc = spec["num_speculative_tokens"], spec["assumed_nextn"], spec["assumed_acceptance"]
        ax.plot(c["spec_effective_tok_s_per_user"], c["spec_effective_tok_s_per_gpu"], "^-",
                label=f"speculative, {n} drafts ({spec['method']}): effective, measured on random weights")
        ax.plot(c["spec_full_acceptance_tok_s_per_user"], c["spec_full_acceptance_tok_s_per_gpu"], "^:",
                label=f"speculative, {n} drafts: full acceptance (1 + {n} tokens a step)")
        assumed = [(x, y) for x, y in zip(c["assumed_tok_s_per_user"], c["assumed_tok_s_per_gpu"]) if x and y]
        if assumed:
            ax.plot(*zip(*assumed), "v--", label=f"ASSUMED acceptance {acc:.0%} at nextn {a} "
                                                 f"(tau {1 + a * acc:g}; not measured)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens/s per user")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(f"{result['model']}, context {result['context_len']}, {result['device']}", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def warm_up(engine: Engine, batch: int, args: argparse.Namespace) -> None:
    """One untimed pass of the first point on other prompts: a fresh engine's first decode steps
    at these positions carry one-time costs (kernel compilation and loading) that the point's own
    warm-up steps did not always cover (5.2 against 2.0 ms/step at B = 1 in the batch-invariant
    mode on an H100, 2026-12-06)."""
    with speculation(engine, None):
        measure_decode(engine, batch, args.context_len, args.warmup, args.steps,
                       torch.Generator().manual_seed(args.seed + 1))
