"""Starting ``deepinfer serve`` replicas (and a router) as child processes on this host, for
``deepinfer serve --replicas N`` and ``deepinfer bench serve --replicas N``.

What belongs here: launching, waiting for /health, stopping. What does not: routing
(policy.py, app.py). Standard library only (urllib), so it runs without the router's extra.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Any, Iterator, Sequence

GENERATING_ROUTES = ("/v1/completions", "/v1/chat/completions")

# How long a replica may take to load its model and answer /health.
START_TIMEOUT_S = 300.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Child:
    """A ``deepinfer`` child process serving HTTP at ``url``."""

    name: str
    url: str
    proc: subprocess.Popen

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False


def cli_command(argv: Sequence[str]) -> list[str]:
    """The command line running ``deepinfer ARGV`` with this interpreter."""
    return [sys.executable, "-m", "deepinfer.entrypoints.cli", *argv]


def start(name: str, argv: Sequence[str], url: str, log: IO | int | None = None) -> Child:
    """Start ``deepinfer ARGV`` (which must serve at ``url``); ``log`` takes its output
    (None: this process's)."""
    proc = subprocess.Popen(cli_command(argv), stdout=log, stderr=subprocess.STDOUT if log is not None else None,
                            env=os.environ.copy())
    return Child(name, url, proc)


def wait_healthy(children: Sequence[Child], timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every child answers /health with 200; RuntimeError if one exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    waiting = list(children)
    while waiting:
        for child in list(waiting):
            code = child.proc.poll()
            if code is not None:
                raise RuntimeError(f"{child.name} ({child.url}) exited with code {code} before it was healthy")
            if child.healthy():
                waiting.remove(child)
        if waiting and time.monotonic() > deadline:
            names = ", ".join(c.name for c in waiting)
            raise RuntimeError(f"{names} not healthy after {timeout_s:g} s")
        if waiting:
            time.sleep(0.2)


def stop(children: Sequence[Child], timeout_s: float = 30.0) -> None:
    """SIGINT (uvicorn's clean shutdown), then SIGKILL for any child still running after ``timeout_s``."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()


def replica_argv(serve_argv: Sequence[str], host: str, port: int) -> list[str]:
    """A replica's command line: the ``serve`` arguments given (engine flags, API key, ...),
    then one replica on ``host:port``. argparse keeps an option's last value, so the
    appended ones win over any given (and a replica never starts replicas itself)."""
    return [*serve_argv, "--replicas", "1", "--host", host, "--port", str(port)]


@contextmanager
def replicas(count: int, serve_argv: Sequence[str], *, host: str = "127.0.0.1", log: IO | int | None = None,
             timeout_s: float = START_TIMEOUT_S) -> Iterator[list[Child]]:
    """``count`` replicas of ``deepinfer serve SERVE_ARGV`` on free ports, healthy when yielded,
    stopped on exit. ``serve_argv`` starts with ``serve`` (global options may come before it)."""
    if count < 1:
        raise ValueError(f"replicas must be >= 1, got {count}")
    children: list[Child] = []
    try:
        for i in range(count):
            port = free_port(host)
            children.append(start(f"replica {i}", replica_argv(serve_argv, host, port), f"http://{host}:{port}", log))
        wait_healthy(children, timeout_s)
        yield children
    finally:
        stop(children)


@contextmanager
def deployment(count: int, serve_argv: Sequence[str], policy: str, *, host: str = "127.0.0.1",
               log: IO | int | None = None) -> Iterator[tuple[str, list[str]]]:
    """``count`` replicas and a ``deepinfer router`` with ``policy`` in front of them, all
    healthy when yielded (the router's URL, the replicas'), stopped on exit."""
    with replicas(count, serve_argv, host=host, log=log) as children:
        urls = [c.url for c in children]
        port = free_port(host)
        router = start("router", ["router", "--backend", *urls, "--policy", policy, "--host", host,
                                  "--port", str(port)], f"http://{host}:{port}", log)
        try:
            wait_healthy([router], timeout_s=60.0)
            yield router.url, urls
        finally:
            stop([router])


def router_requests(router_url: str) -> dict[str, Any]:
    """From a router's /metrics: the generation requests (completions and chat) it sent to each
    backend, and its affinity hits."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    requests: dict[str, float] = {}
    hits = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "deepinfer_router_requests_total" and sample.labels["route"] in GENERATING_ROUTES:
                url = sample.labels["backend"]
                requests[url] = requests.get(url, 0.0) + sample.value
            elif sample.name == "deepinfer_router_affinity_hits_total":
                hits += sample.value
    return {"requests": requests, "affinity_hits": hits}
