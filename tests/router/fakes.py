"""Tiny in-process backends and a router on uvicorn, all in the test's event loop.

A fake backend answers the OpenAI routes with which backend it is and what it received
(JSON, or as server-sent events when the body asks to stream); its ``mode`` makes it
hold requests until released, drop the connection mid-request, or cut a stream short.
"""

from __future__ import annotations

import asyncio
import json
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import uvicorn
from aiohttp import web

from deepinfer.router.app import RouterConfig, build_router_app


@dataclass
class FakeBackend:
    name: str
    url: str = ""
    mode: str = "ok"                 # ok | hold | drop | cut_stream | unhealthy
    received: list[dict[str, Any]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    metrics_text: str | None = None  # its /metrics page (None: 404, as a server without one)
    client_gone: int = 0             # held requests whose client (the router) had gone when released

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        if self.mode == "hold":
            await self.release.wait()
            if request.transport is None or request.transport.is_closing():
                self.client_gone += 1
                return web.Response()
        if self.mode == "drop":
            # As a killed process: the connection closes with no answer.
            request.transport.close()
            return web.Response()
        if body.get("stream") and not body.get("answer_json"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(3):
                await resp.write(f"data: {json.dumps({'backend': self.name, 'chunk': i})}\n\n".encode())
                if self.mode == "cut_stream" and i == 1:
                    await asyncio.sleep(0.05)
                    request.transport.close()
                    return resp
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if body.get("bad"):
            return web.json_response({"error": {"message": "bad: no", "code": 400}}, status=400)
        return web.json_response({"backend": self.name, "body": body})

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=503 if self.mode == "unhealthy" else 200)

    async def metrics(self, _: web.Request) -> web.Response:
        if self.metrics_text is None:
            return web.Response(status=404)
        return web.Response(text=self.metrics_text)

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "root": self.name}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        self.runner = web.AppRunner(app, handle_signals=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def kill(self) -> None:
        """Stop listening: later connections are refused."""
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@asynccontextmanager
async def fake_backends(n: int) -> AsyncIterator[list[FakeBackend]]:
    backends = [FakeBackend(f"b{i}") for i in range(n)]
    for b in backends:
        await b.start()
    try:
        yield backends
    finally:
        for b in backends:
            b.release.set()
            await b.kill()


@asynccontextmanager
async def serve_asgi(app: Any) -> AsyncIterator[str]:
    """``app`` on uvicorn in this event loop, on a free port; yields its URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while not server.started:
            if task.done():
                task.result()
            assert asyncio.get_running_loop().time() < deadline, "the router did not start"
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 20)
        sock.close()


@asynccontextmanager
async def router_over(backends: list[FakeBackend] | list[str], **config: Any) -> AsyncIterator[tuple[str, Any]]:
    """A router over ``backends``; yields its URL and its :class:`Router`."""
    urls = [b if isinstance(b, str) else b.url for b in backends]
    config.setdefault("health_interval_s", 60.0)      # tests trigger checks themselves
    app = build_router_app(RouterConfig(backends=tuple(urls), **config))
    async with serve_asgi(app) as url:
        yield url, app.state.router
