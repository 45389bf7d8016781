"""HTTP/1.1 requests and server-sent events over asyncio streams (standard library only).

The serving benchmark needs one thing from HTTP: to send a JSON body and read the
response *as it arrives*, so that each event of a streamed completion is timed
when its bytes land. This module does that with one connection per request
(``Connection: close``: no pool to size, and a request never waits behind another
one's connection), for ``http`` and ``https`` URLs; the body is read by
``Content-Length``, by chunked transfer coding, or up to the close. Redirects,
proxies and HTTP/2 are not handled: the benchmark talks to the server directly.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

# Read size for bodies that are not chunked.
_READ_BYTES = 1 << 16


class HTTPResponse:
    """Status line and headers of a response whose body has not been read yet."""

    def __init__(self, status: int, reason: str, headers: dict[str, str], reader: asyncio.StreamReader) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers            # lower-case names
        self._reader = reader

    async def iter_body(self) -> AsyncIterator[bytes]:
        """The body in pieces as they arrive (chunk data, not chunk framing)."""
        reader = self._reader
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            while True:
                size_line = await reader.readline()
                if not size_line.endswith(b"\n"):
                    raise ConnectionError("the connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while (await reader.readline()).strip():     # trailer fields, then the blank line
                        pass
                    return
                data = await reader.readexactly(size)
                await reader.readexactly(2)                      # the CRLF after the chunk data
                yield data
        elif "content-length" in self.headers:
            remaining = int(self.headers["content-length"])
            while remaining > 0:
                data = await reader.read(min(remaining, _READ_BYTES))
                if not data:
                    raise ConnectionError(f"the connection closed with {remaining} body bytes unread")
                remaining -= len(data)
                yield data
        else:
            while data := await reader.read(_READ_BYTES):
                yield data

    async def read(self, limit: int = 1 << 20) -> bytes:
        """The whole body (at most ``limit`` bytes are kept)."""
        parts: list[bytes] = []
        size = 0
        async for data in self.iter_body():
            if size < limit:
                parts.append(data[:limit - size])
                size += len(parts[-1])
        return b"".join(parts)

    async def json(self) -> Any:
        return json.loads(await self.read())


@asynccontextmanager
async def request(method: str, url: str, *, body: Any = None,
                  headers: dict[str, str] | None = None) -> AsyncIterator[HTTPResponse]:
    """Send ``method url`` with ``body`` as JSON (when given); yields the response once its
    headers have arrived, and closes the connection on leaving."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    host_header = parts.netloc.rsplit("@", 1)[-1]
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    payload = b"" if body is None else json.dumps(body).encode()
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host_header}", "Connection: close",
             "Accept: application/json, text/event-stream", f"Content-Length: {len(payload)}"]
    if body is not None:
        lines.append("Content-Type: application/json")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    reader, writer = await asyncio.open_connection(
        parts.hostname, port, ssl=ssl.create_default_context() if https else None)
    try:
        writer.write(head + payload)
        await writer.drain()
        status_line = await reader.readline()
        try:
            _, status, *reason = status_line.decode("latin-1").split(" ", 2)
            status_code = int(status)
        except ValueError:
            raise ConnectionError(f"not an HTTP response: {status_line[:80]!r}") from None
        response_headers: dict[str, str] = {}
        while (line := await reader.readline()).strip():
            name, _, value = line.decode("latin-1").partition(":")
            response_headers[name.strip().lower()] = value.strip()
        if not line.endswith(b"\n"):
            raise ConnectionError("the connection closed inside the response headers")
        yield HTTPResponse(status_code, reason[0].strip() if reason else "", response_headers, reader)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass    # the peer went first; the socket is closed either way


class SSEParser:
    """Server-sent events from a byte stream: ``feed`` pieces, get the ``data`` of each
    complete event (several ``data:`` lines of one event are joined with newlines;
    comments and other fields are skipped). ``close`` returns an event the stream
    ended without its terminating blank line."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        self._buffer += data
        events = []
        # Lines end at LF (CRLF and LF both occur); splitting bytes at b"\n" never cuts
        # a UTF-8 character, whose continuation bytes are all >= 0x80.
        *lines, self._buffer = self._buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if not line:
                if self._data:
                    events.append("\n".join(self._data))
                    self._data = []
            elif line.startswith("data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(" ") else value)
        return events

    def close(self) -> list[str]:
        events = self.feed(b"\n\n") if self._buffer else []
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events
