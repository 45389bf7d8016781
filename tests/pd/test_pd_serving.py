"""Prefill/decode disaggregation end to end: ``deepinfer router --prefill ... --decode ...``
over real ``deepinfer serve --role prefill`` and ``--role decode`` apps (the embedded model,
in-process) answers what one instance answers: greedy tokens equal and logprobs within 1e-5,
streams, chat, ``n`` > 1, structured outputs; the decode instance's prompt comes from the
prefill instance's KV blocks (host-tier hits); a lost or hung prefill instance fails its
requests with a 502 and nothing hangs; no block leaks on either side."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import torch

from aiohttp import web

from tests.router.fakes import FakeBackend, router_over
from tests.server.conftest import make_engine, serve

TIMEOUT = aiohttp.ClientTimeout(total=120)     # nothing may hang
LONG = torch.randint(3, 1000, (150,), generator=torch.Generator().manual_seed(3)).tolist()
WORDS = " ".join(f"word{i}" for i in range(60))
REQUESTS = [
    ("/v1/completions", {"prompt": LONG, "max_tokens": 8, "temperature": 0, "logprobs": 2, "ignore_eos": True}),
    ("/v1/completions", {"prompt": LONG[:97], "max_tokens": 6, "temperature": 0.9, "seed": 7, "n": 3,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": LONG[:120], "max_tokens": 6, "temperature": 0, "stream": True,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": WORDS}], "max_tokens": 8, "temperature": 0,
                              "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"prompt": LONG[:110], "max_tokens": 5, "temperature": 0,
                         "structured_outputs": {"regex": "[ab]{3}"}, "ignore_eos": True}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 1}),
]


@pytest.fixture(scope="module")
def servers():
    with serve(make_engine()) as single, serve(make_engine(), role="prefill") as prefill, \
            serve(make_engine(kv_offload_gib=0.01), role="decode") as decode:
        yield single, prefill, decode


async def call(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url + path, json={"model": "tiny-model", **body}) as resp:
        raw = await resp.read()
        if body.get("stream") and resp.status == 200:
            events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
            return resp.status, [e if e == "[DONE]" else json.loads(e) for e in events]
        return resp.status, json.loads(raw)


def choices(answer: Any) -> list[dict[str, Any]]:
    """What must be equal: the choices (a stream's chunks' choices in order), without usage or ids."""
    if isinstance(answer, list):
        return [c for chunk in answer if chunk != "[DONE]" for c in chunk["choices"]]
    return answer["choices"]


def assert_close(got: Any, want: Any, path: str = "") -> None:
    """Equal, but floats (logprobs) within 1e-5."""
    if isinstance(want, float) and isinstance(got, float):
        assert abs(got - want) <= 1e-5, path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for k in want:
            assert_close(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{path}[{i}]")
    else:
        assert got == want, path


def assert_no_leaks(*running) -> None:
    """Every device block free again; the host tier's bytes are exactly its index's entries."""
    def host_consistent(e) -> bool:
        if e.kv.tiers is None:
            return True
        e.runner.kv_tiers.flush()
        index = e.kv.tiers
        return (set(e.runner.kv_tiers.host) == {x.slot for x in index.host.values()}
                and index.host_used == sum(x.nbytes for x in index.host.values()) <= index.host_capacity)

    for s in running:
        s.wait_idle()
        assert s.pool_is_full()
        assert s.engine_call(host_consistent)


@pytest.fixture(params=["inline", "shared"])
def transfer(request, servers):
    """The hand-over; shared memory gets a decode instance of its own, so that its blocks
    come through the shared buffer (the module's decode instance holds them already)."""
    single, prefill, decode = servers
    if request.param == "inline":
        yield request.param, decode
        return
    with serve(make_engine(kv_offload_gib=0.01), role="decode") as fresh:
        yield request.param, fresh


def test_pd_answers_equal_a_single_instance(servers, transfer):
    single, prefill, _ = servers
    kv_transfer, decode = transfer
    staged = prefill.app.state.kv_shares.staged_total

    async def run() -> tuple[list, list, str]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session, \
                router_over([decode.url], prefill=(prefill.url,), kv_transfer=kv_transfer) as (router_url, _):
            want = [await call(session, single.url, path, body) for path, body in REQUESTS]
            # All at once: transfers of some overlap the prefill and decode of others.
            got = await asyncio.gather(*(call(session, router_url, path, body) for path, body in REQUESTS))
            async with session.get(router_url + "/metrics") as resp:
                metrics = await resp.text()
        return want, list(got), metrics

    want, got, metrics = asyncio.run(run())
    for (path, body), (ws, wa), (gs, ga) in zip(REQUESTS, want, got):
        assert ws == gs == 200, (path, body, ga)
        assert_close(choices(ga), choices(wa), path)
    # The long prompts' whole blocks came from the prefill instance (the prompt-logprobs
    # request computes its prompt on the decode instance).
    hits = decode.engine_call(lambda e: e.kv.tier_hits["host"])
    step = decode.engine_call(lambda e: e.kv.hit_step)
    assert hits >= (len(LONG) - 1) // step * step
    plain = [a for (p, b), (_, a) in zip(REQUESTS, got) if not b.get("stream") and "prompt_logprobs" not in b]
    assert all(a["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for a in plain)
    moved = [float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("deepinfer_router_kv_transfer_bytes_total")]
    assert moved and moved[0] > 0
    # Shared: every prefill went through a buffer, released by the router once imported.
    assert prefill.app.state.kv_shares.staged_total - staged == (0 if kv_transfer == "inline" else sum("prompt_logprobs" not in b for _, b in REQUESTS))
    assert len(prefill.app.state.kv_shares) == 0
    assert_no_leaks(single, prefill, decode)


class HungPrefill(FakeBackend):
    """Healthy, but its prefills never answer (a stalled process)."""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/kv/prefill/v1/completions", self.handle)
        app.router.add_get("/health", self.health)
        self.runner = web.AppRunner(app, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


def test_lost_or_hung_prefill_fails_requests_cleanly(servers):
    _, prefill, decode = servers
    path, body = REQUESTS[0]

    async def run() -> list[tuple[int, Any]]:
        hung = HungPrefill("hung", mode="hold")
        dead = FakeBackend("dead")
        await hung.start()
        await dead.start()
        out = []
        try:
            async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
                async with router_over([decode.url], prefill=(dead.url,)) as (router_url, router):
                    await dead.kill()            # lost after the router saw it healthy
                    out.append(await call(session, router_url, path, body))
                    out.append(await call(session, router_url, path, body))    # now known unhealthy
                async with router_over([decode.url], prefill=(hung.url,), prefill_timeout_s=1.0) as (router_url, _):
                    out.append(await asyncio.wait_for(call(session, router_url, path, body), 30))
        finally:
            hung.release.set()
            await hung.kill()
        return out

    before = decode.engine_call(lambda e: e.stats.steps)
    (s1, a1), (s2, a2), (s3, a3) = asyncio.run(run())
    assert s1 == 502 and "prefill" in a1["error"]["message"], a1
    assert s2 == 503 and "no healthy prefill instance" in a2["error"]["message"], a2
    assert s3 == 502 and "TimeoutError" in a3["error"]["message"], a3
    assert decode.engine_call(lambda e: e.stats.steps) == before      # the decode instance never saw them
    assert_no_leaks(prefill, decode)


def test_prefill_errors_reach_the_client(servers):
    _, prefill, decode = servers

    async def run() -> tuple[int, Any]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session, \
                router_over([decode.url], prefill=(prefill.url,)) as (router_url, _):
            return await call(session, router_url, "/v1/completions", {"prompt": [10 ** 9], "max_tokens": 2})

    status, answer = asyncio.run(run())
    assert status == 400 and "out of range" in answer["error"]["message"]


def test_roles_check_their_settings():
    from deepinfer.entrypoints.openai.kv_routes import check_role
    with pytest.raises(ValueError, match="--kv-offload-gib"):
        check_role("decode", 0)
    with pytest.raises(ValueError, match="choose one of prefill, decode"):
        check_role("both", 1)
    check_role("prefill", 0)


def test_short_prompts_skip_the_prefill_instance(servers):
    single, prefill, decode = servers
    path, body = REQUESTS[3]                    # a chat prompt of a few hundred characters

    async def run(min_len: int) -> tuple[int, Any]:
        async with aiohttp.ClientSession(timeout=TIMEOUT) as session, \
                router_over([decode.url], prefill=(prefill.url,), prefill_min_len=min_len) as (router_url, _):
            return await call(session, router_url, path, body)

    asyncio.run(run(0))                         # warm: the same prompt again is a device hit on both
    steps = prefill.engine_call(lambda e: e.stats.steps)
    status, answer = asyncio.run(run(len(WORDS) + 100))
    assert status == 200 and prefill.engine_call(lambda e: e.stats.steps) == steps
    asyncio.run(run(len(WORDS) - 100))
    assert prefill.engine_call(lambda e: e.stats.steps) > steps
    want = asyncio.run(_direct(single.url, path, body))
    assert_close(choices(answer), choices(want))


async def _direct(url: str, path: str, body: dict[str, Any]) -> Any:
    async with aiohttp.ClientSession(timeout=TIMEOUT) as session:
        return (await call(session, url, path, body))[1]
