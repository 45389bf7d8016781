"""``deepinfer bench multiturn``: a multi-turn chat workload through the engine, with prefix
caching on and off, and with the KV cache's host and disk tiers: the prefix-hit rate and the
time to first token.

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

Settings (``--settings``): ``off`` (no prefix caching), ``on`` (the device cache only),
``host`` (plus ``--kv-offload-gib`` of host memory), ``disk`` (the device cache plus a disk
tier, ``--kv-disk-gib`` under ``--kv-disk-dir``, measured *after a restart*: one engine runs
the whole workload and is closed, which writes its tiers to disk; a new engine on the same
directory then runs the timed workload again, so its prompts can hit only in the disk tier).
The ``on`` setting is also what a restart without a disk tier gets: its engine is fresh.
``--num-kv-blocks`` makes the device cache small, so that blocks are evicted. With tiers,
each setting also reports the tokens each tier served and the tiers' transfer bandwidth.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import numpy as np
import torch

from deepinfer.bench.common import (BenchModel, build_engine, free_memory, header, print_table, step_outputs, sync,
                                    write_json)
from deepinfer.engine.engine import Engine
from deepinfer.runner.kv_offload import TransferStats
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
    if not settings or any(s not in SETTINGS for s in settings):
        raise ValueError(f"--settings takes any of {', '.join(SETTINGS)} (comma separated), got {args.settings!r}")
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
    if args.num_kv_blocks is not None:
        result["num_kv_blocks"] = args.num_kv_blocks
    disk_dir = args.kv_disk_dir
    if "disk" in settings and disk_dir is None:
        disk_dir = tempfile.mkdtemp(prefix="deepinfer-kv-disk-")
    for setting in settings:
        tiers: dict[str, Any] = {}
        if setting == "host":
            tiers = dict(kv_offload_gib=args.kv_offload_gib)
        elif setting == "disk":
            tiers = dict(kv_disk_dir=disk_dir, kv_disk_gib=args.kv_disk_gib)

        def engine_for() -> Engine:
            return build_engine(model, args, max_num_seqs=args.conversations, max_num_batched_tokens=budget,
                                max_model_len=longest + 1, enable_prefix_caching=setting != "off",
                                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, **tiers)

        if setting == "disk":
            # The first engine's life: the whole workload, then a clean shutdown that writes
            # its tiers to disk. What follows is a restart.
            first = engine_for()
            run_conversations(first, system, questions, args.answer_len)
            first.close()
            del first
            free_memory(model.device)
        engine = engine_for()
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
        before = _tier_counters(engine)
        run = run_conversations(engine, system, questions, args.answer_len)
        per_turn = [_summary([1e3 * t for t in turn]) for turn in run["ttft_s"]]
        result["runs"][setting] = {
            "ttft_ms": _summary([1e3 * t for turn in run["ttft_s"] for t in turn]),
            "ttft_ms_per_turn": per_turn,
            "prefix_hit_rate": run["cached_tokens"] / run["prompt_tokens"],
            "prompt_tokens": run["prompt_tokens"], "cached_tokens": run["cached_tokens"],
            "wall_s": run["wall_s"], "prompt_tok_s": run["prompt_tokens"] / run["wall_s"],
            "hit_step": engine.kv.hit_step if setting != "off" else None,
            **_tier_report(before, _tier_counters(engine), run["prompt_tokens"])}
        if engine.runner.kv_tiers is not None:
            engine.runner.kv_tiers.close()
        del engine
        free_memory(model.device)
    if {"on", "off"} <= set(result["runs"]):
        result["ttft_mean_on_over_off"] = (result["runs"]["on"]["ttft_ms"]["mean"]
                                           / result["runs"]["off"]["ttft_ms"]["mean"])
    report(result)
    write_json(args.output_json, result)
    return result


# What --settings accepts (the module docstring says what each runs).
SETTINGS = ("on", "off", "host", "disk")


def _tier_counters(engine: Engine) -> dict[str, Any]:
    kv, store = engine.kv, engine.runner.kv_tiers
    stats = store.stats if store is not None else TransferStats()
    return {"hits": dict(kv.tier_hits), "bytes": dict(stats.bytes), "seconds": dict(stats.seconds)}


def _tier_report(before: dict[str, Any], after: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
    """The timed run's share of the tier counters: hit rate per lower tier (tokens it served /
    prompt tokens) and bytes and bandwidth per direction."""
    out: dict[str, Any] = {"tier_hit_rate": {t: (after["hits"][t] - before["hits"][t]) / prompt_tokens
                                             for t in after["hits"]}, "transfers": {}}
    for d in after["bytes"]:
        nbytes = after["bytes"][d] - before["bytes"][d]
        secs = after["seconds"][d] - before["seconds"][d]
        if nbytes:
            out["transfers"][d] = {"bytes": nbytes, "GB_s": nbytes / secs / 1e9 if secs > 0 else None}
    return out


def report(result: dict[str, Any]) -> None:
    print(f"deepinfer bench multiturn: {result['model']}, {result['dtype']} on {result['device']}")
    print(f"multi-turn chat: {result['conversations']} conversations x {result['turns']} turns, system prompt "
          f"{result['system_len']} tokens, questions {result['question_len']}, answers {result['answer_len']}")
    rows = []
    for setting, run in result["runs"].items():
        t = run["ttft_ms"]
        rows.append([setting, f"{run['prefix_hit_rate']:.1%}", f"{t['mean']:.1f}", f"{t['median']:.1f}",
                     f"{t['p90']:.1f}", f"{t['p99']:.1f}", f"{run['wall_s']:.2f}", f"{run['prompt_tok_s']:,.0f}"])
    print_table("prefix caching", ["setting", "hit rate", "TTFT mean ms", "median", "p90", "p99", "wall s",
                                   "prompt tok/s"], rows)
    for setting, run in result["runs"].items():
        if any(run["tier_hit_rate"].values()) or run["transfers"]:
            rates = ", ".join(f"{t} {r:.1%}" for t, r in run["tier_hit_rate"].items())
            moves = ", ".join(f"{d} {v['bytes'] / 2**20:.1f} MiB"
                              + (f" at {v['GB_s']:.2f} GB/s" if v["GB_s"] else "") for d, v in run["transfers"].items())
            print(f"{setting}: hit rate from lower tiers: {rates}; transfers: {moves}")
    for setting, run in result["runs"].items():
        means = ", ".join(f"{s['mean']:.1f}" for s in run["ttft_ms_per_turn"])
        print(f"{setting}: TTFT mean per turn (ms): {means}")
    if "ttft_mean_on_over_off" in result:
        print(f"TTFT mean, caching on / off: {result['ttft_mean_on_over_off']:.3f}")
