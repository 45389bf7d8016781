"""Prometheus metrics with vLLM's names and meanings, in a registry owned by one app.

Latencies are measured on the engine thread when outputs appear; arrival is
when the server accepted the request (so queueing counts towards TTFT):

- ``vllm:time_to_first_token_seconds``: arrival -> first generated token;
- ``vllm:inter_token_latency_seconds``: between consecutive steps that gave a
  request new tokens;
- ``vllm:e2e_request_latency_seconds``: arrival -> finished.

Gauges and the cumulative engine counters (prefix-cache queries/hits in tokens,
preemptions) are refreshed from the engine after every step; prompt tokens
count when a request's prefill completes, generation tokens as they arrive.
With KV-cache tiers, the ``deepinfer:kv_tier_*`` series of deepinfer/metrics.py
(``tier_metrics``): hits per tier, transfer bytes, seconds and bandwidth, usage. With
EPLB, its ``deepinfer:eplb_*`` series (``eplb_metrics``): ``deepinfer:eplb_rebalances_total``,
``deepinfer:eplb_steps_since_rebalance`` and ``deepinfer:eplb_imbalance{when="before|after"}``.
"""

from __future__ import annotations

from typing import Sequence

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

from deepinfer.engine.engine import Engine
from deepinfer.metrics import eplb_metrics, tier_metrics

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

# The KV-cache tiers' series (deepinfer/metrics.py): (help, label, counter or gauge).
_TIER_SERIES = {
    "deepinfer:kv_tier_hit_tokens": ("Prefix-cache hit tokens served by each KV-cache tier.", "tier", True),
    "deepinfer:kv_tier_transfer_bytes": ("Bytes moved between KV-cache tiers.", "direction", True),
    "deepinfer:kv_tier_transfer_seconds": ("Seconds spent moving bytes between KV-cache tiers.", "direction", True),
    "deepinfer:kv_tier_bandwidth_bytes_per_second": ("Mean bandwidth of KV-cache tier transfers.", "direction",
                                                     False),
    "deepinfer:kv_tier_usage_bytes": ("Bytes held in each lower KV-cache tier.", "tier", False),
    "deepinfer:kv_tier_failed_loads": ("Corrupt disk-tier entries found on loading (never used).", None, True),
}

# The expert load balancer's series, in the same form (exported only with EPLB on).
_EPLB_SERIES = {
    "deepinfer:eplb_rebalances": ("Expert load balancing rebalances done.", None, True),
    "deepinfer:eplb_steps_since_rebalance": ("Engine steps since the last expert rebalance.", None, False),
    "deepinfer:eplb_imbalance": ("Expert load imbalance (max / mean tokens per rank) of the last rebalance, "
                                 "before and after it.", "when", False),
}
_SERIES = {**_TIER_SERIES, **_EPLB_SERIES}

# vLLM's bucket boundaries, so dashboards built for it read the same.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels, name = self.registry, ["model_name"], model_name

        def hist(metric: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(metric, doc, labels, buckets=buckets, registry=r).labels(name)

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(metric, doc, labels, registry=r).labels(name)

        def counter(metric: str, doc: str) -> Counter:
            return Counter(metric, doc, labels, registry=r).labels(name)

        self.ttft = hist("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds",
                        "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds",
                        "Histogram of end to end request latency in seconds.", _E2E_BUCKETS)
        self.running = gauge("vllm:num_requests_running",
                             "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted tokens per draft position.", ["model_name", "position"],
                                     registry=r)
        self._success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self._model_name = model_name
        self._series: dict[str, Counter | Gauge] = {
            metric: (Counter if is_counter else Gauge)(metric, doc, labels + ([label] if label else []), registry=r)
            for metric, (doc, label, is_counter) in _SERIES.items()}
        self._seen_series: dict[tuple[str, ...], float] = {}
        # Last seen values of the engine's own cumulative counters.
        self._seen_queries = self._seen_hits = self._seen_preemptions = 0
        self._seen_spec: tuple[int, int, int, list[int]] = (0, 0, 0, [])

    # -- called on the engine thread ---------------------------------------------------------------
    def observe_engine(self, engine: Engine) -> None:
        sched, kv = engine.scheduler, engine.kv
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_usage.set(kv.usage)
        self.prefix_queries.inc(kv.prefix_queries - self._seen_queries)
        self.prefix_hits.inc(kv.prefix_hits - self._seen_hits)
        self.preemptions.inc(sched.num_preemptions - self._seen_preemptions)
        self._seen_queries, self._seen_hits = kv.prefix_queries, kv.prefix_hits
        self._seen_preemptions = sched.num_preemptions
        spec = sched.spec_stats
        self.spec_drafts.inc(spec.num_drafts - self._seen_spec[0])
        self.spec_draft_tokens.inc(spec.num_draft_tokens - self._seen_spec[1])
        self.spec_accepted.inc(spec.num_accepted_tokens - self._seen_spec[2])
        for k, n in enumerate(spec.accepted_per_pos):
            seen = self._seen_spec[3][k] if k < len(self._seen_spec[3]) else 0
            if n > seen:
                self._spec_per_pos.labels(self._model_name, str(k)).inc(n - seen)
        self._seen_spec = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                           list(spec.accepted_per_pos))
        labels = {"model_name": self._model_name}
        for m in tier_metrics(engine, labels) + eplb_metrics(engine, labels):
            series = self._series[m.name].labels(*m.labels.values())
            if _SERIES[m.name][2]:
                ident = (m.name, *m.labels.values())
                series.inc(m.value - self._seen_series.get(ident, 0))
                self._seen_series[ident] = m.value
            else:
                series.set(m.value)

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_inter_token(self, itl_s: float) -> None:
        self.itl.observe(itl_s)

    def on_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def on_finish(self, e2e_s: float, finish_reasons: Sequence[str | None]) -> None:
        # Latency of requests that ran to their end; aborted and failed ones only count.
        if all(reason in ("stop", "length") for reason in finish_reasons):
            self.e2e.observe(e2e_s)
        for reason in finish_reasons:
            if reason is not None:
                self._success.labels(self._model_name, reason).inc()

    # -- called by the /metrics route ----------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
