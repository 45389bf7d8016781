"""The serving benchmark's HTTP, on aiohttp: the session a run sends its requests
through, the server-sent events of a streamed response as they arrive, and the
words a failed request is reported in.

aiohttp comes with the ``bench`` extra (``pip install 'deepinfer[bench]'``). It is
imported here, when a run starts, so that ``deepinfer --help`` and every other
command load without it; ``deepinfer bench serve`` says how to install it.
"""

from __future__ import annotations

import asyncio
import math
from contextlib import asynccontextmanager
from types import ModuleType
from typing import TYPE_CHECKING, AsyncIterator

if TYPE_CHECKING:
    import aiohttp

INSTALL_HINT = "pip install 'deepinfer[bench]'"

# The longest line of an event stream: one event's ``data:`` line, a JSON chunk. aiohttp's
# own limit (twice its read size: 512 KiB) is less than one event of a server that sends
# a long output at once, or many logprobs per token.
MAX_LINE_BYTES = 16 << 20

# How much of a non-200 response's body goes into the request's error.
ERROR_BODY_CHARS = 4096


def aiohttp_module() -> ModuleType:
    """aiohttp, or an ImportError that says how to install it."""
    try:
        import aiohttp
    except ImportError as exc:
        raise ImportError(f"deepinfer bench serve needs aiohttp ({exc}): {INSTALL_HINT}") from exc
    return aiohttp


def request_errors() -> tuple[type[BaseException], ...]:
    """What a request raises when the network or the server fails it: aiohttp's errors
    (refused and dropped connections, truncated bodies) and its timeout."""
    return (aiohttp_module().ClientError, asyncio.TimeoutError)


@asynccontextmanager
async def session(timeout_s: float) -> AsyncIterator[aiohttp.ClientSession]:
    """One session, and so one connection pool, for a whole run (warm-ups included).

    - No cap on open connections (``limit=0``): ``--max-concurrency`` is the runner's to
      enforce; aiohttp's default of 100 would hold back, unseen, the requests above it
      when the rate is ``inf`` or the concurrency higher.
    - Connections are kept alive and reused, as vLLM's client does.
    - ``trust_env=False`` (aiohttp's default, stated): no proxy from ``HTTP(S)_PROXY``,
      no credentials from ``~/.netrc``. The benchmark measures the server it is pointed
      at; a proxy on the way would add its own latency to every figure.
    - Each request, body included, has ``timeout_s`` in all (``--request-timeout``; ``inf``:
      no limit); aiohttp's default would give up after 5 minutes.
    """
    aiohttp = aiohttp_module()
    total = None if math.isinf(timeout_s) else timeout_s      # aiohttp's "no limit"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=total),
                                     trust_env=False) as client:
        yield client


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event of ``response``, as soon as the blank line
    that ends it arrives. Several ``data:`` lines of one event are joined with newlines;
    comments and other fields are skipped; an event the stream ends without its blank
    line is given too. aiohttp splits the body into lines, however its bytes arrive."""
    data: list[str] = []
    while raw := await response.content.readline(max_line_length=MAX_LINE_BYTES):
        line = raw.removesuffix(b"\n").removesuffix(b"\r").decode("utf-8")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


async def error_text(response: aiohttp.ClientResponse) -> str:
    """``HTTP <status> <reason>: <body>`` for a response that is not a success (the body
    is where OpenAI-compatible servers put their error message)."""
    try:
        body = (await response.read()).decode("utf-8", "replace")[:ERROR_BODY_CHARS]
    except aiohttp_module().ClientError as exc:     # a timeout fails the request as one
        body = f"(body unreadable: {describe(exc)})"
    reason = f" {response.reason}" if response.reason else ""
    return f"HTTP {response.status}{reason}: {body}".strip()


def describe(exc: BaseException) -> str:
    """A failed request's reason: the exception's type and message; for a connection
    that could not be made, the operating system's error (``ConnectionRefusedError``)."""
    cause = getattr(exc, "os_error", None)       # aiohttp's ClientConnectorError carries it
    return f"{type(cause if isinstance(cause, OSError) else exc).__name__}: {exc}"
