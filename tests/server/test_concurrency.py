"""Many concurrent streaming clients, clients that go away, and a dead engine."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.engine.engine import Engine
from tests.server.conftest import MODEL, RunningServer, make_engine, serve

PROMPT = "This module provides access to some objects used or maintained by the interpreter"


@pytest.fixture(scope="module")
def server(engine: Engine):
    with serve(engine) as s:
        yield s


def finished_by_reason(server: RunningServer) -> dict[str, float]:
    text = httpx2.get(server.url + "/metrics").text
    return {s.labels["finished_reason"]: s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "vllm:request_success_total" and s.labels.get("model_name") == MODEL}


def wait_until_idle(server: RunningServer, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while server.engine_call(lambda e: e.has_unfinished()):
        assert time.monotonic() < deadline, "the engine still has requests in flight"
        time.sleep(0.05)


async def _client(http: httpx2.AsyncClient, url: str, i: int, leave_after: int | None) -> dict:
    """One streaming completion; with ``leave_after`` the client drops the connection
    after that many events."""
    body = {"model": MODEL, "prompt": f"{i}: {PROMPT}", "stream": True, "temperature": 0.8, "seed": i,
            "max_tokens": 8 if leave_after is None else 400, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    text, events, usage, finish = "", 0, None, None
    async with http.stream("POST", url + "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return {"text": text, "usage": usage, "finish": finish, "done": True}
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            events += 1
            for c in chunk["choices"]:
                text += c["text"]
                finish = c["finish_reason"] or finish
            usage = chunk.get("usage") or usage
            if leave_after is not None and events >= leave_after:
                return {"left": True}
    return {"done": False}


def test_200_streaming_clients_a_third_leave(server):
    rng = random.Random(0)
    leaving = set(rng.sample(range(200), 67))
    before = finished_by_reason(server)

    async def main() -> list[dict]:
        limits = httpx2.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx2.AsyncClient(timeout=60, limits=limits) as http:
            return await asyncio.gather(*(_client(http, server.url, i, 2 if i in leaving else None)
                                          for i in range(200)))

    start = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - start < 60
    for i, r in enumerate(results):
        if i in leaving:
            assert r == {"left": True}
        else:
            assert r["done"] and r["finish"] == "length" and r["text"]
            assert r["usage"]["completion_tokens"] == 8
    wait_until_idle(server)
    assert server.pool_is_full()
    after = finished_by_reason(server)
    # Every client that left was aborted (none ran to its 400 tokens); the rest ran to their length.
    assert after.get("abort", 0) - before.get("abort", 0) == len(leaving)
    assert after.get("length", 0) - before.get("length", 0) == 200 - len(leaving)


def test_non_streaming_client_that_leaves_is_aborted(server):
    before = finished_by_reason(server)
    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(server.url + "/v1/completions", timeout=0.5,
                    json={"prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True})
    wait_until_idle(server, timeout_s=10)
    assert finished_by_reason(server).get("abort", 0) - before.get("abort", 0) == 1
    assert server.pool_is_full()


def test_dead_engine_fails_health_and_requests():
    engine = make_engine(max_num_batched_tokens=256)
    with serve(engine) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        assert httpx2.get(s.url + "/health").status_code == 200

        def broken_step():
            raise RuntimeError("scheduler invariant broken")

        engine.step = broken_step      # a fault outside the per-request isolation kills the loop
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and "scheduler invariant broken" in info.value.message
        health = httpx2.get(s.url + "/health")
        assert health.status_code == 503 and "scheduler invariant broken" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert info.value.status_code == 503


def test_engine_that_can_no_longer_run_stops_serving():
    # What a parallel engine does when a worker dies: it fails its requests and sets ``dead``.
    engine = make_engine(max_num_batched_tokens=256)
    with serve(engine) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        step = engine.step

        def step_then_die():
            engine.dead = "worker rank 1 (pid 123) died (exit code -9)"
            return step()

        engine.step = step_then_die
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503 and "worker rank 1" in info.value.message
        health = httpx2.get(s.url + "/health")
        assert health.status_code == 503 and "worker rank 1" in health.json()["error"]["message"]
