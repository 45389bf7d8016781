"""The router in front of a real ``deepinfer serve`` app (the embedded model, in-process):
what a client gets through it equals what the server answers directly."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from tests.router.fakes import router_over
from tests.server.conftest import API_KEY, make_engine, serve

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    with serve(make_engine(max_num_batched_tokens=512, block_size=1), api_key=API_KEY) as s:
        yield s


def fresh(server) -> None:
    """Idle, with an empty prefix cache (the second call must not report cached tokens)."""
    server.wait_idle()
    server.engine_call(lambda e: e.kv.pool.reset_prefix_cache())


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


async def call(session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any] | None,
               headers: dict[str, str] = HEADERS) -> tuple[int, Any]:
    method = session.post(url + path, json=body, headers=headers) if body is not None else \
        session.get(url + path, headers=headers)
    async with method as resp:
        raw = await resp.read()
        if body is not None and body.get("stream"):
            events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
            return resp.status, [e if e == "[DONE]" else without_ids(json.loads(e)) for e in events]
        return resp.status, json.loads(raw)


def test_responses_equal_a_direct_call(server):
    requests = [
        ("/v1/completions", {"model": "tiny-model", "prompt": "The capital of", "max_tokens": 6, "temperature": 0}),
        ("/v1/completions", {"model": "tiny-model", "prompt": [5, 9, 22, 40], "max_tokens": 4, "temperature": 0,
                             "logprobs": 2}),
        ("/v1/chat/completions", {"model": "tiny-model", "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 5, "temperature": 0}),
        ("/v1/completions", {"model": "tiny-model", "prompt": "Once", "max_tokens": 5, "temperature": 0,
                             "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", {"model": "tiny-model", "messages": [{"role": "user", "content": "Hello"}],
                                  "max_tokens": 4, "temperature": 0, "stream": True}),
        ("/v1/completions", {"model": "tiny-model", "prompt": "x", "max_tokens": -1}),      # a 400
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}),                     # a 404
    ]

    async def test() -> None:
        async with router_over([server.url]) as (url, _), aiohttp.ClientSession() as s:
            for path, body in requests:
                await asyncio.to_thread(fresh, server)
                direct = await call(s, server.url, path, body)
                await asyncio.to_thread(fresh, server)
                routed = await call(s, url, path, body)
                if direct[0] == 200 and not body.get("stream"):
                    direct, routed = (direct[0], without_ids(direct[1])), (routed[0], without_ids(routed[1]))
                assert routed == direct, path
            assert await call(s, url, "/v1/models", None) == await call(s, server.url, "/v1/models", None)
            tok = {"model": "tiny-model", "prompt": "Hello world"}
            assert await call(s, url, "/tokenize", tok) == await call(s, server.url, "/tokenize", tok)
            # The backend checks the API key; its 401 passes through.
            status, body = await call(s, url, "/v1/models", None, headers={})
            assert status == 401 and body["error"]["code"] == "invalid_api_key"

    asyncio.run(asyncio.wait_for(test(), 120))
