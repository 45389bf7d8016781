"""The engine's cumulative counters and gauges as vLLM's metric reader objects
(``vllm.v1.metrics.reader``): what ``LLM.get_metrics()`` returns, with vLLM's names.

The server exports the same values to Prometheus (entrypoints/openai/metrics.py), plus
request latencies this offline view does not keep.

With KV-cache tiers (``kv_offload_bytes`` / ``kv_disk_*``), ``tier_metrics`` adds ours:
``deepinfer:kv_tier_hit_tokens{tier}`` (of ``vllm:prefix_cache_hits``, the tokens each tier
served: ``device``, ``host``, ``disk``; divided by ``vllm:prefix_cache_queries``, each
tier's hit rate), ``deepinfer:kv_tier_transfer_bytes{direction}`` and
``deepinfer:kv_tier_transfer_seconds{direction}`` (device_to_host, host_to_device,
host_to_disk, disk_to_device; their ratio is the bandwidth, also given as the gauge
``deepinfer:kv_tier_bandwidth_bytes_per_second``), ``deepinfer:kv_tier_usage_bytes{tier}``
and ``deepinfer:kv_tier_failed_loads`` (corrupt disk entries found, never used).
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
    out += tier_metrics(engine, labels)
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


def tier_metrics(engine: "Engine", labels: dict[str, str]) -> list[Metric]:
    """The KV-cache tiers' counters (module docstring); none without tiers."""
    kv, store = engine.kv, engine.runner.kv_tiers
    if kv.tiers is None or store is None:
        return []
    hits = {"device": kv.prefix_hits - sum(kv.tier_hits.values()), **kv.tier_hits}
    out: list[Metric] = [Counter("deepinfer:kv_tier_hit_tokens", {**labels, "tier": t}, n) for t, n in hits.items()]
    stats = store.stats
    for d in stats.bytes:
        out += [Counter("deepinfer:kv_tier_transfer_bytes", {**labels, "direction": d}, stats.bytes[d]),
                Gauge("deepinfer:kv_tier_transfer_seconds", {**labels, "direction": d}, stats.seconds[d]),
                Gauge("deepinfer:kv_tier_bandwidth_bytes_per_second", {**labels, "direction": d},
                      stats.bandwidth(d))]
    out += [Gauge("deepinfer:kv_tier_usage_bytes", {**labels, "tier": "host"}, float(kv.tiers.host_used)),
            Gauge("deepinfer:kv_tier_usage_bytes", {**labels, "tier": "disk"}, float(kv.tiers.disk_used)),
            Counter("deepinfer:kv_tier_failed_loads", dict(labels), kv.tiers.stats.failed_loads)]
    return out
