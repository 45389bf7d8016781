"""``deepinfer bench multiturn``: a multi-turn chat workload through the engine, with prefix
caching on and off: the prefix-hit rate and the time to first token.

Workload (random token ids, seeded): one shared system prompt of ``--system-len`` tokens;
``--conversations`` conversations of ``--turns`` turns, all open at once. A turn's prompt
is the conversation so far (system prompt, then each earlier question and the answer the
engine generated for it) plus a new question of ``--question-len`` tokens; the answer is
``--answer-len`` tokens (EOS ignored). A conversation sends its next turn as soon as its
answer is complete, so the engine always holds one request per open conversation.

Each setting first runs a warm-up of whole conversations of the same lengths on other tokens
(``--warmup-conversations``: by default all of them on a GPU, so that every batch shape of
the timed run, which Triton specialises kernels on, is compiled and captured before it; 4 on
the CPU, which compiles nothing), then empties the prefix cache.
Reported per setting (caching on, then off, each on a fresh engine with the same weights
and workload): time to first token (mean, median, p90, p99) over all turns and per turn,
prefix-hit rate (cached prompt tokens / prompt tokens, from ``num_cached_tokens``),
prompt tokens per second, and the wall time of the whole workload.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from deepinfer.bench.common import (BenchModel, build_engine, free_memory, header, print_table, step_outputs, sync,
                                    write_json)
from deepinfer.engine.engine import Engine
from deepinfer.sampling_params import SamplingParams

# Conversations of the warm-up pass on the CPU (whole ones, the timed run's lengths).
CPU_WARMUP_CONVERSATIONS = 4


def _workload(args: argparse.Namespace, vocab: int) -> tuple[list[int], list[list[list[int]]]]:
    gen = torch.Generator().manual_seed(args.seed)
    system = torch.randint(0, vocab, (args.system_len,), generator=gen).tolist()
    questions = [[torch.randint(0, vocab, (args.question_len,), generator=gen).tolist()
                  for _ in range(args.turns)] for _ in range(args.conversations)]
    return system, questions


def run_conversations(engine: Engine, system: list[int], questions: list[list[list[int]]],
                      answer_len: int) -> dict[str, Any]:
    """Drive every conversation to its end; returns per-turn TTFTs, hit counts and timings."""
    params = SamplingParams(temperature=0.0, max_tokens=answer_len, ignore_eos=True)
    history = [list(system) for _ in questions]
    turn = [0] * len(questions)
    owner: dict[str, int] = {}
    sent: dict[str, float] = {}
    ttft: list[list[float]] = [[] for _ in range(len(questions[0]))]
    prompt_tokens = cached_tokens = 0

    def send(c: int) -> None:
        history[c] += questions[c][turn[c]]
        rid = engine.add_request(list(history[c]), params, request_id=f"c{c}t{turn[c]}")
        owner[rid] = c
        sent[rid] = time.perf_counter()

    start = time.perf_counter()
    for c in range(len(questions)):
        send(c)
    first_seen: set[str] = set()
    while owner:
        for out in step_outputs(engine):
            c = owner.get(out.request_id)
            if c is None:
                continue
            if out.outputs[0].token_ids and out.request_id not in first_seen:
                first_seen.add(out.request_id)
                ttft[turn[c]].append(time.perf_counter() - sent[out.request_id])
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                cached_tokens += out.num_cached_tokens
                history[c] += out.outputs[0].token_ids
                del owner[out.request_id]
                turn[c] += 1
                if turn[c] < len(questions[c]):
                    send(c)
    sync(engine.config.device)
    wall = time.perf_counter() - start
    return {"ttft_s": ttft, "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens, "wall_s": wall}


def _summary(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def run_multiturn(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.system_len, args.conversations, args.turns, args.question_len, args.answer_len) < 1:
        raise ValueError("--system-len, --conversations, --turns, --question-len and --answer-len must be >= 1")
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings or any(s not in ("on", "off") for s in settings):
        raise ValueError(f"--settings takes 'on' and/or 'off' (comma separated), got {args.settings!r}")
    model = BenchModel.from_args(args)
    longest = args.system_len + args.turns * (args.question_len + args.answer_len)
    fit = model.check_fits(args.conversations * (longest + 1))
    result = header("multiturn", model, {}, args.argv)
    result["memory"] = fit
    system, questions = _workload(args, int(model.hf_config["vocab_size"]))
    budget = args.max_num_batched_tokens or max(4096, args.question_len * args.conversations)
    result.update(system_len=args.system_len, conversations=args.conversations, turns=args.turns,
                  question_len=args.question_len, answer_len=args.answer_len, block_size=args.block_size,
                  max_num_batched_tokens=budget, runs={})
    for setting in settings:
        engine = build_engine(model, args, max_num_seqs=args.conversations, max_num_batched_tokens=budget,
                              max_model_len=longest + 1, enable_prefix_caching=setting == "on",
                              block_size=args.block_size)
        # Warm-up: whole conversations of the same shape on other tokens, so that kernels are
        # compiled (Triton specialises on sizes) and graphs captured for the lengths, batch
        # sizes and hit positions the timed run meets; then the prefix cache is emptied.
        vocab = int(model.hf_config["vocab_size"])
        shifted = [(t + 1) % vocab for t in system]
        count = args.warmup_conversations
        if count is None:
            count = args.conversations if model.device.type == "cuda" else CPU_WARMUP_CONVERSATIONS
        warm = [[[(t + 1) % vocab for t in q] for q in conv] for conv in questions[:count]]
        run_conversations(engine, shifted, warm, args.answer_len)
        engine.kv.pool.reset_prefix_cache()
        run = run_conversations(engine, system, questions, args.answer_len)
        per_turn = [_summary([1e3 * t for t in turn]) for turn in run["ttft_s"]]
        result["runs"][setting] = {
            "ttft_ms": _summary([1e3 * t for turn in run["ttft_s"] for t in turn]),
            "ttft_ms_per_turn": per_turn,
            "prefix_hit_rate": run["cached_tokens"] / run["prompt_tokens"],
            "prompt_tokens": run["prompt_tokens"], "cached_tokens": run["cached_tokens"],
            "wall_s": run["wall_s"], "prompt_tok_s": run["prompt_tokens"] / run["wall_s"],
            "hit_step": engine.kv.hit_step if setting == "on" else None}
        del engine
        free_memory(model.device)
    if {"on", "off"} <= set(result["runs"]):
        result["ttft_mean_on_over_off"] = (result["runs"]["on"]["ttft_ms"]["mean"]
                                           / result["runs"]["off"]["ttft_ms"]["mean"])
    report(result)
    write_json(args.output_json, result)
    return result


def report(result: dict[str, Any]) -> None:
    print(f"deepinfer bench multiturn: {result['model']}, {result['dtype']} on {result['device']}")
    print(f"multi-turn chat: {result['conversations']} conversations x {result['turns']} turns, system prompt "
          f"{result['system_len']} tokens, questions {result['question_len']}, answers {result['answer_len']}")
    rows = []
    for setting, run in result["runs"].items():
        t = run["ttft_ms"]
        rows.append([setting, f"{run['prefix_hit_rate']:.1%}", f"{t['mean']:.1f}", f"{t['median']:.1f}",
                     f"{t['p90']:.1f}", f"{t['p99']:.1f}", f"{run['wall_s']:.2f}", f"{run['prompt_tok_s']:,.0f}"])
    print_table("prefix caching", ["caching", "hit rate", "TTFT mean ms", "median", "p90", "p99", "wall s",
                                   "prompt tok/s"], rows)
    for setting, run in result["runs"].items():
        means = ", ".join(f"{s['mean']:.1f}" for s in run["ttft_ms_per_turn"])
        print(f"{setting}: TTFT mean per turn (ms): {means}")
    if "ttft_mean_on_over_off" in result:
        print(f"TTFT mean, caching on / off: {result['ttft_mean_on_over_off']:.3f}")
