"""A real uvicorn server on 127.0.0.1 (a free port) in a background thread, over the
embedded tiny model on the CPU. Servers share one engine, one server at a time."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from deepinfer.engine.engine import Engine
from deepinfer.entrypoints.llm import build_engine_config
from deepinfer.entrypoints.openai.api_server import build_app
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

API_KEY = "sk-test-key"
MODEL = "tiny-model"


@dataclass
class RunningServer:
    url: str               # http://127.0.0.1:PORT
    engine: Engine
    app: FastAPI

    def engine_call(self, fn: Callable[[Engine], Any], timeout_s: float = 30.0) -> Any:
        """fn(engine) on the engine thread, the only thread that may touch the engine."""
        return asyncio.run(self.app.state.async_engine.call(fn, timeout_s))

    def pool_is_full(self) -> bool:
        return self.engine_call(lambda e: e.kv.num_free_blocks == e.kv.pool.num_blocks - 1)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until the engine holds no unfinished request (e.g. one a previous test's client
        dropped, which keeps stepping until its abort lands)."""
        deadline = time.monotonic() + timeout_s
        while self.engine_call(lambda e: e.has_unfinished()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine still has unfinished requests after {timeout_s} s")
            time.sleep(0.01)


@contextmanager
def serve(engine: Engine, **app_kwargs: Any) -> Iterator[RunningServer]:
    app = build_app(engine, **app_kwargs)
    # proto=IPPROTO_TCP so that asyncio sets TCP_NODELAY on accepted connections (it checks
    # the protocol); without it every response pays a delayed-ACK stall.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(url=f"http://127.0.0.1:{port}", engine=engine, app=app)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def generate_direct(server: RunningServer, prompt: str | list[int], params: SamplingParams) -> RequestOutput:
    """The engine's own answer, computed on the engine thread while the server is idle."""
    def run(e: Engine) -> RequestOutput:
        rid = e.add_request(prompt, params, request_id=f"direct-{uuid.uuid4().hex}")
        while True:
            for out in e.step():
                if out.request_id == rid and out.finished:
                    return out
    return server.engine_call(run, 60)


def make_engine(**kwargs: Any) -> Engine:
    return Engine(build_engine_config(device="cpu", **kwargs))


@pytest.fixture(scope="session")
def engine() -> Engine:
    # block_size=1 keeps prefix-cache hits possible on short prompts: a hit is a whole
    # number of every KV group's blocks (64 tokens for the embedded DeepSeek-V4's
    # ratio-16 group at this size).
    return make_engine(max_num_batched_tokens=512, block_size=1)
