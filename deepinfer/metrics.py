"""The engine's cumulative counters and gauges as vLLM's metric reader objects
(``vllm.v1.metrics.reader``): what ``LLM.get_metrics()`` returns, with vLLM's names.

The server exports the same values to Prometheus (entrypoints/openai/metrics.py), plus
request latencies this offline view does not keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.engine.engine import Engine


@dataclass
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Counter(Metric):
    value: int = 0


@dataclass
class Gauge(Metric):
    value: float = 0.0


@dataclass
class Vector(Metric):
    """A counter per position (``values[k]``: position k)."""

    values: list[int] = field(default_factory=list)


def engine_metrics(engine: "Engine", model_name: str) -> list[Metric]:
    sched, kv = engine.scheduler, engine.kv
    labels = {"model_name": model_name}
    spec = sched.spec_stats
    out: list[Metric] = [
        Gauge("vllm:num_requests_running", dict(labels), float(len(sched.running))),
        Gauge("vllm:num_requests_waiting", dict(labels), float(len(sched.waiting))),
        Gauge("vllm:kv_cache_usage_perc", dict(labels), kv.usage),
        Counter("vllm:prefix_cache_queries", dict(labels), kv.prefix_queries),
        Counter("vllm:prefix_cache_hits", dict(labels), kv.prefix_hits),
        Counter("vllm:num_preemptions", dict(labels), sched.num_preemptions),
    ]
    if engine.config.speculative is not None:
        out += [
            Counter("vllm:spec_decode_num_drafts", dict(labels), spec.num_drafts),
            Counter("vllm:spec_decode_num_draft_tokens", dict(labels), spec.num_draft_tokens),
            Counter("vllm:spec_decode_num_accepted_tokens", dict(labels), spec.num_accepted_tokens),
            Vector("vllm:spec_decode_num_accepted_tokens_per_pos", dict(labels),
                   spec.accepted_per_pos + [0] * (engine.config.speculative.num_speculative_tokens
                                                  - len(spec.accepted_per_pos))),
        ]
    return out
