"""KV-cache tiers behind the OpenAI server: a resumed prompt whose blocks left the device
cache is served from the host tier and says so in ``usage.prompt_tokens_details.cached_tokens``;
/metrics reports hits per tier and transfers; a server shutdown writes the tiers to disk,
where the next engine finds them."""

from __future__ import annotations

import httpx2
import torch
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL, make_engine, serve


def _tokens(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=g).tolist()


def test_host_tier_hit_cached_tokens_metrics_and_shutdown(tmp_path):
    tiers = dict(num_kv_blocks=30, kv_offload_gib=0.01, kv_disk_dir=str(tmp_path), kv_disk_gib=0.01)
    engine = make_engine(**tiers)
    g = torch.Generator().manual_seed(0)
    first, question = _tokens(200, g), _tokens(20, g)
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with serve(engine) as s:
        def complete(prompt: list[int]) -> dict:
            return httpx2.post(s.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60).json()

        answer = complete(first)
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        for _ in range(3):                      # unrelated prompts push the first out of the device
            complete(_tokens(150, g))
        resumed = first + s.engine_call(lambda e: e.tokenizer.encode(answer["choices"][0]["text"],
                                                                     add_special_tokens=False)) + question
        reply = complete(resumed)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 128
        text = httpx2.get(s.url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") == MODEL:
                samples[(sample.name, sample.labels.get("tier") or sample.labels.get("direction"))] = sample.value
    assert samples[("deepinfer:kv_tier_hit_tokens_total", "host")] == engine.kv.tier_hits["host"] >= cached
    assert samples[("deepinfer:kv_tier_transfer_bytes_total", "device_to_host")] > 0
    assert samples[("deepinfer:kv_tier_transfer_bytes_total", "host_to_device")] > 0
    assert samples[("deepinfer:kv_tier_usage_bytes", "host")] > 0     # (the shutdown emptied it since)
    # The shutdown wrote the tiers to disk: a new engine on the directory finds them.
    restarted = make_engine(**tiers)
    assert len(restarted.kv.tiers.disk) > 0
