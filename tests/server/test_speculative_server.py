"""Speculative decoding behind the OpenAI server: a greedy completion is the engine's output
without drafts, and /metrics reports vLLM's spec-decode counters."""

from __future__ import annotations

import httpx2
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.sampling_params import SamplingParams
from tests.server.conftest import MODEL, generate_direct, make_engine, serve

# The embedded model answers this with a run of repeated escapes, which n-gram lookup drafts.
PROMPT = "def f(x):\n    return x\ndef f(x):\n    return x\ndef f("


def test_speculative_server_output_and_metrics():
    plain = make_engine()
    want = None
    with serve(plain) as s:
        want = generate_direct(s, PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    engine = make_engine(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with serve(engine) as s:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        reply = httpx2.post(s.url + "/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == want.outputs[0].text
        text = httpx2.get(s.url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") == MODEL:
                samples[(sample.name, sample.labels.get("position"))] = sample.value
    stats = engine.scheduler.spec_stats
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == stats.num_drafts > 0
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == stats.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens > 0
    per_pos = [samples.get(("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(k)), 0.0) for k in range(3)]
    assert sum(per_pos) == stats.num_accepted_tokens
