"""The router over tiny fake backends: affinity, load balance, health, failover (non-streamed
retried elsewhere, streamed given a clean error), pass-through of bodies and statuses, and
its /metrics."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.router.app import RouterConfig
from deepinfer.router.policy import CacheAwareConfig
from tests.router.fakes import fake_backends, router_over

SYSTEM = "You are a helpful assistant. " * 8


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 60))


def chat(conv: int, turns: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"conversation {conv} question {t}"})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {t} to conversation {conv}"})
    return {"model": "fake", "messages": messages}


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               path: str = "/v1/chat/completions") -> tuple[int, Any]:
    async with session.post(url + path, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple], float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_conversations_stick_to_their_replica_and_spread():
    async def test() -> None:
        async with fake_backends(2) as backends, router_over(backends) as (url, _), aiohttp.ClientSession() as s:
            for b in backends:
                b.mode = "hold"
            # Four conversations open at once: the first turns spread (load), though all share the system prompt.
            first = [asyncio.create_task(post(s, url, chat(c, 1))) for c in range(4)]
            while sum(len(b.received) for b in backends) < 4:
                await asyncio.sleep(0.01)
            for b in backends:
                b.mode = "ok"
                b.release.set()
            homes = {json.dumps(r[1]["body"]["messages"][1]): r[1]["backend"] for r in await asyncio.gather(*first)}
            assert sorted(homes.values()) == ["b0", "b0", "b1", "b1"]
            # Later turns, sent one at a time (idle replicas), go back to the replica holding the history.
            for turns in (2, 3):
                for c in range(4):
                    status, body = await post(s, url, chat(c, turns))
                    assert status == 200
                    assert body["backend"] == homes[json.dumps(chat(c, 1)["messages"][1])]
            m = await metrics(s, url)
            assert m[("deepinfer_router_affinity_hits_total", (("backend", backends[0].url),))] >= 4
            assert m[("deepinfer_router_decisions_total", (("reason", "affinity"),))] >= 8
    run(test)


def test_load_balance_when_one_replica_is_overloaded():
    async def test() -> None:
        config = CacheAwareConfig(load_weight=0.0, balance_abs_threshold=2, balance_rel_threshold=1.5)
        async with fake_backends(2) as backends, router_over(backends, cache_aware=config) as (url, router), \
                aiohttp.ClientSession() as s:
            for b in backends:
                b.mode = "hold"
            # load_weight 0: the cache alone decides, so the same prompt piles onto one replica ...
            held = [asyncio.create_task(post(s, url, chat(0, 1))) for _ in range(3)]
            while router.backends[backends[0].url].in_flight + router.backends[backends[1].url].in_flight < 3:
                await asyncio.sleep(0.01)
            loads = sorted(b.in_flight for b in router.backends.values())
            assert loads == [0, 3]
            hot = next(b for b in backends if router.backends[b.url].in_flight == 3)
            cold = next(b for b in backends if b is not hot)
            # ... until it has more than 2 above the other: then the guard sends it to the idle one.
            cold.mode = "ok"
            status, body = await post(s, url, chat(0, 1))
            assert (status, body["backend"]) == (200, cold.name)
            hot.release.set()
            await asyncio.gather(*held)
            m = await metrics(s, url)
            assert m[("deepinfer_router_decisions_total", (("reason", "balance"),))] == 1
    run(test)


def held(running: int, waiting: int) -> str:
    """A backend's /metrics page with vLLM's request gauges."""
    return (f'vllm:num_requests_running{{model_name="m"}} {running}\n'
            f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n')


def test_load_counts_other_clients_requests_from_the_backends_metrics():
    async def test() -> None:
        async with fake_backends(2) as backends, router_over(backends) as (url, router), \
                aiohttp.ClientSession() as s:
            b0, b1 = backends
            # Idle replicas, the cache decides: the second conversation turn follows the first.
            assert (await post(s, url, chat(0, 1)))[1]["backend"] == "b0"
            # b0 is busy with other clients' requests (7 running, 2 waiting): a new prompt goes to b1,
            # and even the conversation's next turn (its history on b0 is worth less than 9 requests).
            b0.metrics_text = held(7, 2)
            await router.check_health()
            assert (router.backends[b0.url].external, router.backends[b1.url].external) == (9, 0)
            assert (await post(s, url, chat(1, 1)))[1]["backend"] == "b1"
            assert (await post(s, url, chat(0, 2)))[1]["backend"] == "b1"
            # The router's own requests are not counted twice: with 2 of its own in flight on b0, a
            # page saying 5 leaves 3 to other clients.
            b0.metrics_text = held(4, 1)
            router.backends[b0.url].in_flight = 2
            await router.check_health()
            assert (router.backends[b0.url].external, router.backends[b0.url].load) == (3, 5)
            router.backends[b0.url].in_flight = 0
            b0.metrics_text = "not a metrics page {"
            await router.check_health()
            assert router.backends[b0.url].external == 0
            m = await metrics(s, url)
            assert m[("deepinfer_router_backend_external_requests", (("backend", b0.url),))] == 0
    run(test)


def test_non_streamed_request_is_retried_when_a_backend_dies():
    async def test() -> None:
        async with fake_backends(2) as backends, router_over(backends, policy="round-robin") as (url, router), \
                aiohttp.ClientSession() as s:
            a, b = backends
            a.mode = "drop"              # dies mid-request: the connection closes with no answer
            status, body = await post(s, url, {"prompt": "hello", "max_tokens": 4}, "/v1/completions")
            assert (status, body["backend"]) == (200, "b1")
            assert len(a.received) == 1 and len(b.received) == 1
            assert not router.backends[a.url].healthy
            # While a is unhealthy, nothing goes there.
            for _ in range(3):
                assert (await post(s, url, {"prompt": "x"}, "/v1/completions"))[1]["backend"] == "b1"
            assert len(a.received) == 1
            # A killed backend (connection refused) comes back unhealthy from its check; b serves.
            a.mode = "ok"
            await router.check_health()
            assert router.backends[a.url].healthy
            await a.kill()
            for _ in range(2):           # round robin: one of the two is sent to a first
                status, body = await post(s, url, {"prompt": "y"}, "/v1/completions")
                assert (status, body["backend"]) == (200, "b1")
            m = await metrics(s, url)
            assert m[("deepinfer_router_retries_total", (("backend", a.url),))] == 2
            assert m[("deepinfer_router_backend_healthy", (("backend", a.url),))] == 0
            assert m[("deepinfer_router_backend_healthy", (("backend", b.url),))] == 1
            # Every backend down: a 502 naming what failed, then 503 with none healthy.
            b.mode = "drop"
            status, body = await post(s, url, {"prompt": "z"}, "/v1/completions")
            assert status == 502 and "every backend tried failed" in body["error"]["message"]
            status, body = await post(s, url, {"prompt": "z"}, "/v1/completions")
            assert status == 503 and "no healthy backend" in body["error"]["message"]
            async with s.get(url + "/health") as resp:
                assert resp.status == 503
    run(test)


async def read_events(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    async with session.post(url + "/v1/completions", json=body) as resp:
        text = (await resp.read()).decode()
        return resp.status, [e.removeprefix("data: ") for e in text.split("\n\n") if e]


def test_streamed_request_gets_a_clean_error_when_its_backend_dies():
    async def test() -> None:
        async with fake_backends(2) as backends, router_over(backends, policy="round-robin") as (url, router), \
                aiohttp.ClientSession() as s:
            a, b = backends
            a.mode = "cut_stream"
            status, events = await read_events(s, url, {"prompt": "p", "stream": True})
            assert status == 200
            assert [json.loads(e) for e in events[:2]] == [{"backend": "b0", "chunk": 0}, {"backend": "b0", "chunk": 1}]
            error = json.loads(events[2])["error"]
            assert error["code"] == 502 and "failed mid-stream" in error["message"]
            assert events[3:] == ["[DONE]"]
            assert not router.backends[a.url].healthy and router.backends[a.url].in_flight == 0
            # A stream whose backend is refused before any byte is retried elsewhere, whole.
            a.mode = "ok"
            await router.check_health()
            await a.kill()
            status, events = await read_events(s, url, {"prompt": "p", "stream": True})
            assert [json.loads(e)["backend"] for e in events[:3]] == ["b1"] * 3 and events[3:] == ["[DONE]"]
            m = await metrics(s, url)
            assert m[("deepinfer_router_stream_errors_total", (("backend", a.url),))] == 1
    run(test)


def test_pass_through_bodies_statuses_and_headers():
    async def test() -> None:
        async with fake_backends(1) as backends, router_over(backends) as (url, _), aiohttp.ClientSession() as s:
            body = {"model": "fake", "prompt": [1, 2, 3], "max_tokens": 2, "extra": {"nested": [1, None]}}
            routed = await post(s, url, body, "/v1/completions")
            direct = await post(s, backends[0].url, body, "/v1/completions")
            assert routed == direct == (200, {"backend": "b0", "body": body})
            # A stream asked for but answered as JSON (a server without streaming) passes as it is.
            body = {"prompt": "x", "stream": True, "answer_json": True}
            assert await post(s, url, body, "/v1/completions") == (200, {"backend": "b0", "body": body})
            assert await post(s, url, {"bad": True, "prompt": "x"}, "/v1/completions") == \
                (400, {"error": {"message": "bad: no", "code": 400}})
            async with s.get(url + "/v1/models") as resp:
                assert (await resp.json())["data"] == [{"id": "fake", "root": "b0"}]
                assert resp.content_type == "application/json"
                # The backend's Date and Server are not copied beside the router's own.
                assert len(resp.headers.getall("Date")) == len(resp.headers.getall("Server")) == 1
            async with s.get(url + "/health") as resp:
                assert resp.status == 200
            # Malformed JSON is the backend's to refuse (routed with no key).
            async with s.post(url + "/v1/completions", data=b"{not json",
                              headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 500          # aiohttp's fake fails to parse it; the status passes through
    run(test)


def test_unhealthy_backend_gets_nothing_until_it_recovers():
    async def test() -> None:
        async with fake_backends(2) as backends:
            backends[0].mode = "unhealthy"
            async with router_over(backends, policy="round-robin") as (url, router), aiohttp.ClientSession() as s:
                assert [b.healthy for b in router.backends.values()] == [False, True]
                for _ in range(4):
                    assert (await post(s, url, {"prompt": "q"}, "/v1/completions"))[1]["backend"] == "b1"
                backends[0].mode = "ok"
                await router.check_health()
                got = {(await post(s, url, {"prompt": "q"}, "/v1/completions"))[1]["backend"] for _ in range(4)}
                assert got == {"b0", "b1"}
                m = await metrics(s, url)
                assert m[("deepinfer_router_requests_total", (("backend", backends[1].url),
                                                              ("route", "/v1/completions")))] == 6
    run(test)


def test_a_client_that_goes_away_is_gone_for_the_backend_too():
    async def test() -> None:
        async with fake_backends(1) as backends, router_over(backends) as (url, router):
            b = backends[0]
            b.mode = "hold"
            for stream in (False, True):
                async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.5)) as s:
                    with pytest.raises(asyncio.TimeoutError):
                        await post(s, url, {"prompt": "p", "stream": stream}, "/v1/completions")
                while router.backends[b.url].in_flight:
                    await asyncio.sleep(0.01)
            b.release.set()
            while b.client_gone < 2:
                await asyncio.sleep(0.01)
            assert len(b.received) == 2 and router.backends[b.url].healthy
    run(test)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="backends: give at least one"):
        RouterConfig(backends=())
    with pytest.raises(ValueError, match="is not an http"):
        RouterConfig(backends=("localhost:8000",))
    with pytest.raises(ValueError, match="listed twice"):
        RouterConfig(backends=("http://a:1", "http://a:1/"))
    with pytest.raises(ValueError, match="unknown routing policy"):
        RouterConfig(backends=("http://a:1",), policy="fastest")
    with pytest.raises(ValueError, match="max_retries"):
        RouterConfig(backends=("http://a:1",), max_retries=-1)
