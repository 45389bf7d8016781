"""The serving benchmark's accounting, with ``vllm bench serve``'s definitions and names.

Over the successful requests (times in ms in the results):

- TTFT: time to first token; E2EL: end-to-end latency (send to last token).
- TPOT: (E2EL - TTFT) / (output tokens - 1) per request, the first token excluded;
  requests of one token have none (for goodput their TPOT counts as 0).
- ITL: every gap between consecutive output events, all requests pooled.
- Throughputs divide by the benchmark's duration: completed requests, output
  tokens, and input + output tokens per second. Request goodput: requests that
  met every SLO of ``--goodput`` (TTFT, TPOT, E2EL at most the given ms) per second.
- Statistics: mean, median, population std and linearly interpolated percentiles
  (numpy's defaults, as vLLM); an empty list gives 0.
- Peak output token throughput: the most output tokens in one 1-second bucket from
  the first send. An event's tokens are its request's output tokens shared evenly
  over the request's events (vLLM counts one token per event, which undercounts
  when events carry several). Peak concurrent requests: the most requests in
  flight at once (intervals [send, last token)).
- Multi-turn workload: the prefix-cache hit rate (the servers' cached prompt tokens over
  prompt tokens, completed requests) and the mean TTFT of each turn.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from deepinfer.bench.serve.endpoint import RequestResult

# name -> (label in the result block, section header), in print order.
PERCENTILE_METRICS: dict[str, tuple[str, str]] = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
SLO_METRICS = ("ttft", "tpot", "e2el")


def parse_percentile_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in PERCENTILE_METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics: {', '.join(bad) or 'nothing given'} is not one of "
                         f"{', '.join(PERCENTILE_METRICS)}")
    return names


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise ValueError(f"--metric-percentiles must be comma-separated numbers, got {text!r}") from exc
    if not values or any(not 0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be numbers in [0, 100], got {text!r}")
    return values


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:100", "tpot:50"]`` -> {"ttft": 100.0, "tpot": 50.0} (ms)."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not sep or name not in SLO_METRICS or not ms >= 0:
            raise ValueError(f"--goodput takes KEY:VALUE pairs with KEY one of {', '.join(SLO_METRICS)} "
                             f"and VALUE a number of ms >= 0, got {pair!r}")
        slos[name] = ms
    return slos


def percentile_key(p: float) -> str:
    """``99`` -> "99", ``99.9`` -> "99.9" (as vLLM writes p99_ttft_ms, p99.9_ttft_ms)."""
    return str(int(p)) if int(p) == p else str(p)


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(np.std(ms))}
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def tpot(result: RequestResult) -> float | None:
    """(E2EL - TTFT) / (output tokens - 1) in seconds; None for a request of one token."""
    assert result.output_tokens is not None
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """(peak output tokens in a 1-second bucket, peak requests in flight)."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    buckets = np.zeros(int(math.ceil(max(r.start_time + r.latency for r in ok) - t0)) + 1)
    for r in ok:
        times = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        np.add.at(buckets, (times - t0).astype(np.int64), r.output_tokens / len(times))
    # Sweep over [send, end): at equal times an end (-1) sorts before a start (+1).
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return float(buckets.max()), peak


def compute_metrics(results: Sequence[RequestResult], duration_s: float, *,
                    percentile_metrics: Sequence[str], percentiles: Sequence[float],
                    goodput: dict[str, float]) -> dict[str, Any]:
    """The aggregate results (vLLM's keys). Successful results must have ``output_tokens`` set."""
    ok = [r for r in results if r.success]
    if any(r.output_tokens is None for r in ok):
        raise ValueError("compute_metrics: every successful result needs output_tokens")
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [tpot(r) for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens or 0 for r in ok)

    good = None
    if goodput:
        per_request = {"ttft": ttfts, "tpot": [t or 0.0 for t in tpots], "e2el": e2els}
        good = sum(all(per_request[name][i] * 1000.0 <= slo for name, slo in goodput.items())
                   for i in range(len(ok)))
    peak_tokens, peak_requests = _peaks(ok)
    metrics: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": None if good is None else good / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    values = {"ttft": ttfts, "tpot": [t for t in tpots if t is not None], "itl": itls, "e2el": e2els}
    for name in percentile_metrics:
        metrics |= _stats(name, values[name], percentiles)
    return metrics


def per_request(results: Sequence[RequestResult], t0: float) -> dict[str, list]:
    """vLLM's detailed fields (``--save-detailed``); times in s, sends from the benchmark start."""
    return {
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [(r.output_tokens or 0) if r.success else 0 for r in results],
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time - t0 for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
    }


def _line(label: str, value: Any) -> str:
    return f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}"


def format_result(metrics: dict[str, Any], *, max_concurrency: int | None, request_rate: float,
                  percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """vLLM's result block."""
    lines = [f"{' Serving Benchmark Result ':=^50}",
             _line("Successful requests:", metrics["completed"]),
             _line("Failed requests:", metrics["failed"])]
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if not math.isinf(request_rate):
        lines.append(_line("Request rate configured (RPS):", float(request_rate)))
    lines += [_line("Benchmark duration (s):", metrics["duration"]),
              _line("Total input tokens:", metrics["total_input_tokens"]),
              _line("Total generated tokens:", metrics["total_output_tokens"]),
              _line("Request throughput (req/s):", metrics["request_throughput"])]
    if metrics["request_goodput"] is not None:
        lines.append(_line("Request goodput (req/s):", metrics["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", metrics["output_throughput"]),
              _line("Peak output token throughput (tok/s):", metrics["max_output_tokens_per_s"]),
              _line("Peak concurrent requests:", float(metrics["max_concurrent_requests"])),
              _line("Total token throughput (tok/s):", metrics["total_token_throughput"])]
    for name in PERCENTILE_METRICS:
        if name not in percentile_metrics:
            continue
        label, header = PERCENTILE_METRICS[name]
        lines += [f"{header:-^50}",
                  _line(f"Mean {label} (ms):", metrics[f"mean_{name}_ms"]),
                  _line(f"Median {label} (ms):", metrics[f"median_{name}_ms"])]
        lines += [_line(f"P{percentile_key(p)} {label} (ms):", metrics[f"p{percentile_key(p)}_{name}_ms"])
                  for p in percentiles]
    lines.append("=" * 50)
    return "\n".join(lines)


def multiturn_metrics(results: Sequence[RequestResult], turns: Sequence[int]) -> dict[str, Any]:
    """The multi-turn workload's own figures: the prefix-hit rate (cached prompt tokens / prompt
    tokens over completed requests, from the servers' ``usage``; None when a server does not
    report cached tokens) and the mean TTFT of each turn."""
    ok = [(r, t) for r, t in zip(results, turns) if r.success]
    prompt = sum(r.prompt_len for r, _ in ok)
    reported = bool(ok) and all(r.cached_tokens is not None for r, _ in ok)
    cached = sum(r.cached_tokens or 0 for r, _ in ok) if reported else None
    per_turn: dict[int, list[float]] = {}
    for r, t in ok:
        per_turn.setdefault(t, []).append(r.ttft)
    return {
        "total_cached_tokens": cached,
        "prefix_hit_rate": cached / prompt if cached is not None and prompt else None,
        "mean_ttft_ms_per_turn": [1000.0 * float(np.mean(per_turn[t])) for t in sorted(per_turn)],
    }


def format_multiturn(figures: dict[str, Any]) -> str:
    rate = figures["prefix_hit_rate"]
    lines = [_line("Prefix-cache hit rate:", "not reported" if rate is None else f"{100 * rate:.1f}%"),
             _line("Mean TTFT per turn (ms):", ", ".join(f"{t:.1f}" for t in figures["mean_ttft_ms_per_turn"]))]
    return "\n".join(lines)
