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

With expert load balancing (``enable_eplb``), ``eplb_metrics`` adds ours:
``deepinfer:eplb_rebalances`` (rebalances done), ``deepinfer:eplb_steps_since_rebalance``
and ``deepinfer:eplb_imbalance{when}``: the last rebalance's load imbalance (max / mean tokens
per rank, averaged over the MoE layers; 1.0 is balanced, 0.0 before the first rebalance),
``before`` it (measured) and ``after`` it (the new placement on the same load).
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
    out += eplb_metrics(engine, labels)
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
    kv = engine.kv
    # A parallel engine has no tiers, and its runner (the executor) no kv_tiers.
    if kv.tiers is None or engine.runner.kv_tiers is None:
        return []
    store = engine.runner.kv_tiers
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


def eplb_metrics(engine: "Engine", labels: dict[str, str]) -> list[Metric]:
    """The expert load balancer's counters (module docstring): rank 0's, as of the last
    finished step; none without EPLB."""
    if not engine.config.parallel.enable_eplb:
        return []
    stats = engine.runner.eplb_stats
    return [Counter("deepinfer:eplb_rebalances", dict(labels), stats.rebalances),
            Gauge("deepinfer:eplb_steps_since_rebalance", dict(labels), float(stats.steps_since_rebalance)),
            Gauge("deepinfer:eplb_imbalance", {**labels, "when": "before"}, stats.imbalance_before),
            Gauge("deepinfer:eplb_imbalance", {**labels, "when": "after"}, stats.imbalance_after)]
