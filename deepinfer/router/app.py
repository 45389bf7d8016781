"""The router's HTTP side: a FastAPI app that passes the OpenAI API through to one of
several ``deepinfer serve`` replicas (or any OpenAI-compatible servers) chosen by a
``RoutingPolicy``, checks their health, retries elsewhere when one fails, and reports its
own Prometheus metrics.

What belongs here: forwarding (bodies and statuses unchanged, streams relayed as their
bytes arrive), backend state (health, requests in flight), retries, /metrics, and the
prefill/decode mode's prefill and KV hand-over. What does not: the choice of replica
(policy.py), starting replicas (replicas.py), the KV export format (engine/kv_transfer.py).

- Routes passed through: POST /v1/completions and /v1/chat/completions (routed by the
  policy), GET /v1/models, POST /tokenize and /detokenize (any healthy replica). Headers go
  both ways but for hop-by-hop ones, so ``Authorization`` reaches the backends, which
  check it. GET /health: 200 while some backend is healthy, else 503. GET /metrics: the
  router's own.
- Load: the requests the router has in flight on each backend (a streamed one until its
  last byte is relayed), plus those other clients had there at the last health check (the
  backend's running and waiting requests, from its /metrics, less the router's own then).
- Health: every ``health_interval_s`` each backend's /health (200 = healthy). A backend
  that refuses a connection or drops one mid-request is marked unhealthy at once and the
  policy forgets what it was sent (a restarted replica's cache is empty); a later health
  check brings it back.
- Retries: a request whose backend fails before answering (connection refused or reset,
  a 503, a non-streamed body cut off) is sent again to another healthy backend, up to
  ``max_retries`` times; the policy chooses among the backends not yet tried. A streamed
  response whose backend dies after its first bytes were relayed cannot be replayed: the
  client gets an error event (OpenAI's error shape, status 502) and ``data: [DONE]``.
- Prefill/decode disaggregation (``prefill`` URLs given; ``backends`` are then the decode
  instances, ``deepinfer serve --role prefill|decode``): a generating request is first sent
  to a prefill instance (the policy's choice among them), which computes its prompts and
  answers their KV blocks; the router posts those to the decode instance chosen for the
  request (``/kv/import``, into its host tier), then forwards the request there as usual:
  its prefix lookup finds the blocks, so it recomputes only the prompt's last partial
  block and its output is a single instance's. Transfers go over HTTP (TCP), each
  request's on its own, so one request's transfer overlaps others' prefill, transfer and
  decode. A prefill instance that fails (connection refused or reset, 502/503/504, no
  answer within ``prefill_timeout_s``) is marked unhealthy and another is tried, up to
  ``max_retries`` times; then the client gets a 502 naming each failure, and the decode
  instance never sees the request. A prefill's own error answer (a 400 for a bad request)
  is the client's. Requests asking for prompt logprobs skip the prefill (their decode
  instance computes the whole prompt anyway), and so do prompts shorter than
  ``prefill_min_len`` (routing-key elements: characters, or token ids), which cost the
  decode instance less than the round trip would. With ``kv_transfer="shared"``
  (``--kv-transfer shared``: prefill and decode instances on one host) the blocks stay in a
  buffer the prefill instance shares (CUDA IPC between GPUs, shared memory on the CPU;
  engine/kv_share.py) and only its handle passes through the router; the router releases
  the buffer once the decode instance has imported it. A shared buffer is opened at most
  once: when that import's decode instance fails, the request goes on to another without
  the blocks (it computes the prompt itself; the output is the same).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, AsyncIterator, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.router.policy import CacheAwareConfig, Key, RoutingPolicy, make_policy, routing_key

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'deepinfer[router]'"

# Headers that describe one connection, not the message: never forwarded (RFC 9110 §7.6.1),
# nor Host (the backend's own) and Content-Length (recomputed for the forwarded body).
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                         "trailer", "transfer-encoding", "upgrade", "host", "content-length"})

# Response headers the router's own server writes (uvicorn): not copied, or they would appear twice.
_SERVER_OWN = frozenset({"date", "server"})

# The gauges of a backend's /metrics that count the requests it holds (vLLM's names).
_HELD_GAUGES = frozenset({"vllm:num_requests_running", "vllm:num_requests_waiting"})

# Statuses that say the backend, not the request, failed: another replica may serve it.
_RETRY_STATUSES = frozenset({502, 503, 504})

# The prefill instance's KV hand-over (entrypoints/openai/kv_routes.py).
KV_TRANSFERS = ("inline", "shared")
_TRANSFER_HEADER = "X-DeepInfer-KV-Transfer"
_SHARE_HEADER = "X-DeepInfer-KV-Share"


def aiohttp_module() -> ModuleType:
    """aiohttp (the router's HTTP client), or an ImportError that says how to install it."""
    try:
        import aiohttp
    except ImportError as exc:
        raise ImportError(f"the router needs aiohttp ({exc}): {INSTALL_HINT}") from exc
    return aiohttp


@dataclass(frozen=True)
class RouterConfig:
    """``deepinfer router``'s settings (its flags of the same names)."""

    backends: tuple[str, ...]
    policy: str = "cache-aware"
    cache_aware: CacheAwareConfig = field(default_factory=CacheAwareConfig)
    max_retries: int = 2
    health_interval_s: float = 5.0
    health_timeout_s: float = 5.0
    request_timeout_s: float = 6 * 60 * 60
    prefill: tuple[str, ...] = ()        # prefill instances (PD mode); backends are then the decode ones
    prefill_timeout_s: float = 600.0     # a prefill instance's answer (the prompts' KV) within this
    prefill_min_len: int = 0             # shorter routing keys (prompt characters or token ids) skip prefill
    kv_transfer: str = "inline"          # "shared": prefill and decode instances share the KV buffer (one host)

    def __post_init__(self) -> None:
        # One spelling per backend: it names the backend in the metrics and the policy.
        object.__setattr__(self, "backends", tuple(url.rstrip("/") for url in self.backends))
        object.__setattr__(self, "prefill", tuple(url.rstrip("/") for url in self.prefill))
        if not self.backends:
            raise ValueError("backends: give at least one backend URL (--backend http://HOST:PORT)")
        for name in ("backends", "prefill"):
            for url in getattr(self, name):
                if not url.startswith(("http://", "https://")):
                    raise ValueError(f"{name}: {url!r} is not an http(s):// URL")
        urls = self.backends + self.prefill
        if len(set(urls)) != len(urls):
            raise ValueError(f"backends, prefill: a URL is listed twice in {list(urls)}")
        make_policy(self.policy)                   # names the policies on a typo
        if self.prefill_min_len < 0:
            raise ValueError(f"prefill_min_len must be >= 0, got {self.prefill_min_len}")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ValueError(f"kv_transfer={self.kv_transfer!r}: choose one of {', '.join(KV_TRANSFERS)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s", "prefill_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class Backend:
    url: str
    healthy: bool = False
    in_flight: int = 0          # this router's requests on it, now
    external: int = 0           # requests it held at the last check beyond this router's then
    last_error: str = ""

    @property
    def load(self) -> int:
        return self.in_flight + self.external


class RouterMetrics:
    """Prometheus metrics of one router app, in its own registry."""

    def __init__(self, backends: Sequence[str]) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("deepinfer_router_requests", "Requests sent to each backend (retries included).",
                                ["backend", "route"], registry=r)
        self.decisions = Counter("deepinfer_router_decisions",
                                 "Routing decisions by reason: affinity (the backend was sent a prefix of the "
                                 "prompt before), load, balance (load guard), round_robin.", ["reason"], registry=r)
        self.affinity_hits = Counter("deepinfer_router_affinity_hits",
                                     "Requests routed to a backend that was sent a prefix of them before.",
                                     ["backend"], registry=r)
        self.matched = Counter("deepinfer_router_matched_prefix_elements",
                               "Routing-key elements (characters or token ids) the chosen backend was sent "
                               "before.", registry=r)
        self.key_elements = Counter("deepinfer_router_key_elements", "Routing-key elements of routed requests.",
                                    registry=r)
        self.retries = Counter("deepinfer_router_retries",
                               "Requests sent again to another backend after this one failed them.", ["backend"],
                               registry=r)
        self.stream_errors = Counter("deepinfer_router_stream_errors",
                                     "Streamed responses cut off by a backend failure (an error event sent).",
                                     ["backend"], registry=r)
        self.failed = Counter("deepinfer_router_failed_requests",
                              "Requests answered with an error because no backend could serve them.", registry=r)
        self.healthy = Gauge("deepinfer_router_backend_healthy", "1 while the backend is healthy.", ["backend"],
                             registry=r)
        self.in_flight = Gauge("deepinfer_router_backend_in_flight",
                               "This router's requests in flight on the backend.", ["backend"], registry=r)
        self.external = Gauge("deepinfer_router_backend_external_requests",
                              "Requests other clients held on the backend at the last check.", ["backend"],
                              registry=r)
        self.kv_transfer_bytes = Counter("deepinfer_router_kv_transfer_bytes",
                                         "KV-block bytes moved from prefill to decode instances.", registry=r)
        self.kv_transfer_seconds = Counter("deepinfer_router_kv_transfer_seconds",
                                           "Seconds spent in each PD stage: prefill (the prefill instance's "
                                           "answer) and import (the decode instance's).", ["stage"], registry=r)
        self.prefill_failures = Counter("deepinfer_router_prefill_failures",
                                        "Prefills a prefill instance failed (it is then marked unhealthy).",
                                        ["backend"], registry=r)
        for url in backends:
            self.healthy.labels(url).set(0)
            self.in_flight.labels(url).set(0)
            self.external.labels(url).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI's error body, as the backends write theirs."""
    return JSONResponse(_error_body(status, message), status_code=status)


def _error_body(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": None, "code": status}}


def _wants_prefill(body: Any) -> bool:
    """Whether a request gains from a prefill instance: not one asking for prompt logprobs
    (its decode instance computes the whole prompt for them), nor a body the backend will
    refuse anyway."""
    if not isinstance(body, dict):
        return False
    return body.get("prompt_logprobs") is None and not (body.get("echo") and body.get("logprobs") is not None)


def _forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _requests_held(metrics_text: str) -> int | None:
    """``vllm:num_requests_running`` + ``vllm:num_requests_waiting`` (summed over their label
    sets) from a Prometheus text page; None when neither is there or the page does not parse."""
    try:
        families = list(text_string_to_metric_families(metrics_text))
    except ValueError:
        return None
    values = [sample.value for family in families for sample in family.samples
              if sample.name in _HELD_GAUGES]
    return int(sum(values)) if values else None


@dataclass
class _Prefilled:
    """A prefill instance's answer: the KV export, and for a shared one its buffer's id."""

    blob: bytes
    prefill_url: str
    share_id: str | None = None
    opened: bool = False        # a decode instance mapped the buffer (or may have)


class _BackendFailed(Exception):
    """The backend failed a request before any of its answer reached the client."""


class Router:
    """The backends, their state and the policy; ``forward`` sends one request."""

    def __init__(self, config: RouterConfig, policy: RoutingPolicy | None = None) -> None:
        self.config = config
        self.policy = policy or make_policy(config.policy, config.cache_aware if config.policy == "cache-aware"
                                            else None)
        self.backends = {url: Backend(url) for url in config.backends}
        # PD mode: the prefill instances, chosen by a policy of their own (prefix affinity to
        # their caches too).
        self.prefills = {url: Backend(url) for url in config.prefill}
        self.prefill_policy = make_policy(config.policy, config.cache_aware if config.policy == "cache-aware"
                                          else None)
        self.metrics = RouterMetrics(list(self.backends) + list(self.prefills))
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        aiohttp = aiohttp_module()
        total = None if math.isinf(self.config.request_timeout_s) else self.config.request_timeout_s
        # No cap on connections (the backends queue); bytes passed as they are (no decompression);
        # no proxy from the environment between the router and its replicas.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                              timeout=aiohttp.ClientTimeout(total=total),
                                              auto_decompress=False, trust_env=False)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started (Router.start runs in the app's lifespan)")
        return self._session

    # -- health ------------------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await self.check_health()

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(b) for b in [*self.backends.values(), *self.prefills.values()]))

    async def _check(self, backend: Backend) -> None:
        aiohttp = aiohttp_module()
        try:
            async with self.session.get(backend.url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as resp:
                await resp.read()
                ok, why = resp.status == 200, f"/health answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            ok, why = False, f"/health: {type(exc).__name__}: {exc}"
        if ok:
            self._set_healthy(backend)
            await self._poll_load(backend)
        else:
            self.mark_unhealthy(backend, why)

    async def _poll_load(self, backend: Backend) -> None:
        """The backend's requests running and waiting (vLLM's gauges, which our server exports)
        less this router's own in flight: the load other clients put on it. 0 when the
        backend does not export them."""
        aiohttp = aiohttp_module()
        mine = backend.in_flight
        try:
            async with self.session.get(backend.url + "/metrics",
                                        timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as resp:
                text = (await resp.read()).decode("utf-8", "replace") if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError):
            text = ""
        held = _requests_held(text)
        backend.external = max(0, held - mine) if held is not None else 0
        self.metrics.external.labels(backend.url).set(backend.external)

    def _set_healthy(self, backend: Backend) -> None:
        if not backend.healthy:
            logger.warning("backend %s is healthy", backend.url)
        backend.healthy, backend.last_error = True, ""
        self.metrics.healthy.labels(backend.url).set(1)

    def mark_unhealthy(self, backend: Backend, why: str) -> None:
        if backend.healthy:
            logger.warning("backend %s is unhealthy: %s", backend.url, why)
            # When it comes back its cache is likely empty (restarted): forget what it was sent.
            (self.prefill_policy if backend.url in self.prefills else self.policy).forget(backend.url)
        backend.healthy, backend.last_error = False, why
        self.metrics.healthy.labels(backend.url).set(0)

    # -- forwarding --------------------------------------------------------------------------------
    def _candidates(self, tried: set[str]) -> list[str]:
        return [url for url, b in self.backends.items() if b.healthy and url not in tried]

    def _no_backend(self, errors: list[str]) -> JSONResponse:
        self.metrics.failed.inc()
        if errors:
            return error_response(502, f"every backend tried failed this request: {'; '.join(errors)}")
        return error_response(503, self.unhealthy_message())

    def unhealthy_message(self) -> str:
        down = "; ".join(f"{b.url}: {b.last_error or 'not checked yet'}"
                         for b in [*self.backends.values(), *self.prefills.values()])
        return f"no healthy backend ({down})"

    async def forward(self, method: str, path: str, request: Request, *, routed: bool) -> Response:
        """Send ``request`` to a backend: chosen by the policy when ``routed`` (the generating
        routes), else the least busy healthy one; retried elsewhere on a backend failure. If the
        client disconnects before the answer (or a stream's first bytes), the backend request is
        cancelled and its connection dropped, so the backend aborts it too."""
        body = await request.body()
        work = asyncio.ensure_future(self._forward(method, path, request, body, routed=routed))
        watch = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        # 499 (nginx's "client closed request"): nobody reads it, the access log shows it.
        return Response(status_code=499) if work.cancelled() else work.result()

    async def _forward(self, method: str, path: str, request: Request, body: bytes, *, routed: bool) -> Response:
        headers = _forward_headers(request.headers)
        key: Key = ""
        stream = False
        parsed: Any = None
        if routed:
            try:
                parsed = json.loads(body)
            except (json.JSONDecodeError, UnicodeDecodeError):
                parsed = None          # the backend answers it with its own 400
            if isinstance(parsed, dict):
                key, stream = routing_key(parsed), parsed.get("stream") is True
        prefilled: _Prefilled | None = None
        if routed and self.prefills and len(key) >= self.config.prefill_min_len and _wants_prefill(parsed):
            answer = await self._prefill(key, path, body, headers)
            if isinstance(answer, Response):
                return answer
            prefilled = answer
        try:
            return await self._decode(method, path, body, headers, key, stream, routed, prefilled)
        finally:
            if prefilled is not None and prefilled.share_id is not None:
                await self._release(prefilled)

    async def _decode(self, method: str, path: str, body: bytes, headers: dict[str, str], key: Key, stream: bool,
                      routed: bool, prefilled: _Prefilled | None) -> Response:
        blob = None if prefilled is None else prefilled.blob
        tried: set[str] = set()
        errors: list[str] = []
        failed: Backend | None = None
        for _ in range(1 + self.config.max_retries):
            candidates = self._candidates(tried)
            if not candidates:
                break
            if failed is not None:
                self.metrics.retries.labels(failed.url).inc()
            backend = self._choose(key, candidates, routed)
            tried.add(backend.url)
            self.metrics.requests.labels(backend.url, path).inc()
            try:
                if blob is not None:
                    try:
                        refused = await self._import(backend, blob, headers, prefilled)
                    finally:
                        if prefilled.share_id is not None:
                            blob = None      # a shared buffer is opened once; others compute the prompt
                    if refused is not None:
                        return refused
                return await self._send(backend, method, path, body, headers, stream)
            except _BackendFailed as exc:
                errors.append(f"{backend.url}: {exc}")
                self.mark_unhealthy(backend, str(exc))
                failed = backend
        return self._no_backend(errors)

    def _choose(self, key: Key, candidates: list[str], routed: bool) -> Backend:
        loads = {url: self.backends[url].load for url in candidates}
        if not routed:
            return self.backends[min(candidates, key=lambda u: loads[u])]
        now = time.monotonic()
        decision = self.policy.choose(key, candidates, loads, now)
        self.policy.record(key, decision.replica, now)
        self.metrics.decisions.labels(decision.reason).inc()
        self.metrics.key_elements.inc(len(key))
        self.metrics.matched.inc(decision.matched)
        if decision.reason == "affinity":
            self.metrics.affinity_hits.labels(decision.replica).inc()
        return self.backends[decision.replica]

    async def _send(self, backend: Backend, method: str, path: str, body: bytes, headers: dict[str, str],
                    stream: bool) -> Response:
        aiohttp = aiohttp_module()
        self._enter(backend)
        handed_over = False
        try:
            try:
                resp = await self.session.request(method, backend.url + path, data=body or None, headers=headers,
                                                  allow_redirects=False)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                raise _BackendFailed(f"{type(exc).__name__}: {exc}") from exc
            if resp.status in _RETRY_STATUSES:
                try:
                    text = (await resp.read()).decode("utf-8", "replace")[:300]
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    text = f"(body unreadable: {type(exc).__name__})"
                finally:
                    resp.release()
                raise _BackendFailed(f"HTTP {resp.status}: {text}")
            out_headers = {k: v for k, v in _forward_headers(resp.headers).items()
                           if k.lower() not in _SERVER_OWN}
            if stream and resp.status == 200 and resp.content_type == "text/event-stream":
                handed_over = True       # the relay leaves the backend when the stream ends
                return StreamingResponse(self._relay(backend, resp), status_code=resp.status, headers=out_headers)
            try:
                data = await resp.read()
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                resp.close()
                raise _BackendFailed(f"the response was cut off: {type(exc).__name__}: {exc}") from exc
            except asyncio.CancelledError:
                resp.close()         # the client went away: dropping the connection aborts the request there
                raise
            resp.release()
            return Response(data, status_code=resp.status, headers=out_headers)
        finally:
            if not handed_over:
                self._leave(backend)

    async def _relay(self, backend: Backend, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The backend's stream, chunk by chunk as it arrives; an error event and ``[DONE]``
        if the backend fails before its own ``[DONE]``."""
        aiohttp = aiohttp_module()
        tail = b""
        complete = False
        try:
            try:
                async for chunk in resp.content.iter_any():
                    tail = (tail + chunk)[-32:]
                    yield chunk
                complete = tail.rstrip().endswith(b"data: [DONE]")
                failure = "the stream ended before 'data: [DONE]'"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failure = f"{type(exc).__name__}: {exc}"
            if not complete:
                self.metrics.stream_errors.labels(backend.url).inc()
                self.mark_unhealthy(backend, failure)
                message = f"backend {backend.url} failed mid-stream: {failure}"
                yield f"data: {json.dumps(_error_body(502, message))}\n\ndata: [DONE]\n\n".encode()
        finally:
            # Closing (not releasing) drops the connection, so a backend whose client went away
            # sees the disconnect and aborts the request.
            resp.close()
            self._leave(backend)

    # -- prefill/decode disaggregation ------------------------------------------------------------
    async def _prefill(self, key: Key, path: str, body: bytes, headers: dict[str, str]) -> _Prefilled | Response:
        """The request's prompts' KV blocks from a prefill instance (retried on another when one
        fails), or the response the client gets: the prefill's own error answer, or a 502 /
        503 when no prefill instance could serve it."""
        aiohttp = aiohttp_module()
        tried: set[str] = set()
        errors: list[str] = []
        for _ in range(1 + self.config.max_retries):
            candidates = [url for url, b in self.prefills.items() if b.healthy and url not in tried]
            if not candidates:
                break
            now = time.monotonic()
            decision = self.prefill_policy.choose(key, candidates, {u: self.prefills[u].load for u in candidates}, now)
            self.prefill_policy.record(key, decision.replica, now)
            prefill = self.prefills[decision.replica]
            tried.add(prefill.url)
            self.metrics.requests.labels(prefill.url, "/kv/prefill" + path).inc()
            self._enter(prefill)
            t0 = time.perf_counter()
            share_id = None
            try:
                async with self.session.post(prefill.url + "/kv/prefill" + path, data=body,
                                             headers={**headers, _TRANSFER_HEADER: self.config.kv_transfer},
                                             timeout=aiohttp.ClientTimeout(total=self.config.prefill_timeout_s)
                                             ) as resp:
                    data = await resp.read()
                    status, content_type = resp.status, resp.headers.get("Content-Type", "application/json")
                    share_id = resp.headers.get(_SHARE_HEADER)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                status, data, content_type = 0, why.encode(), ""
            finally:
                self._leave(prefill)
            self.metrics.kv_transfer_seconds.labels("prefill").inc(time.perf_counter() - t0)
            if status == 200:
                if share_id is None:
                    self.metrics.kv_transfer_bytes.inc(len(data))
                return _Prefilled(data, prefill.url, share_id)
            if status and status not in _RETRY_STATUSES:
                return Response(data, status_code=status, media_type=content_type)
            why = data.decode("utf-8", "replace")[:300]
            why = f"HTTP {status}: {why}" if status else why
            errors.append(f"prefill {prefill.url}: {why}")
            self.metrics.prefill_failures.labels(prefill.url).inc()
            self.mark_unhealthy(prefill, why)
        self.metrics.failed.inc()
        if errors:
            return error_response(502, f"every prefill instance tried failed this request: {'; '.join(errors)}")
        down = "; ".join(f"{b.url}: {b.last_error or 'not checked yet'}" for b in self.prefills.values())
        return error_response(503, f"no healthy prefill instance ({down})")

    async def _import(self, backend: Backend, blob: bytes, headers: dict[str, str],
                      prefilled: _Prefilled) -> Response | None:
        """Post the prefilled KV blocks to the decode instance ``backend``: None once it holds
        them, the client's 502 when it refuses them (another model or cache layout); a
        connection failure raises ``_BackendFailed`` (another decode instance is tried).
        Notes in ``prefilled`` whether the instance mapped a shared buffer (when it cannot
        be known, it may have)."""
        aiohttp = aiohttp_module()
        headers = {**{k: v for k, v in headers.items() if k.lower() != "content-type"},
                   "Content-Type": "application/x-deepinfer-kv"}
        t0 = time.perf_counter()
        prefilled.opened = True
        try:
            async with self.session.post(backend.url + "/kv/import", data=blob, headers=headers) as resp:
                text = (await resp.read()).decode("utf-8", "replace")
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _BackendFailed(f"KV import: {type(exc).__name__}: {exc}") from exc
        finally:
            self.metrics.kv_transfer_seconds.labels("import").inc(time.perf_counter() - t0)
        if status == 200 and prefilled.share_id is not None:
            try:
                answer = json.loads(text)
                prefilled.opened = bool(answer["opened"])
                self.metrics.kv_transfer_bytes.inc(int(answer["bytes"]))
            except (ValueError, KeyError, TypeError):
                pass
        elif status not in _RETRY_STATUSES:
            prefilled.opened = False      # refused before mapping anything (kv_routes.py)
        if status in _RETRY_STATUSES:
            raise _BackendFailed(f"KV import: HTTP {status}: {text[:300]}")
        if status != 200:
            self.metrics.failed.inc()
            return error_response(502, f"decode instance {backend.url} refused the prefilled KV blocks "
                                       f"(HTTP {status}): {text[:300]}")
        return None

    async def _release(self, prefilled: _Prefilled) -> None:
        """Tell the prefill instance its shared buffer is done with (it frees it; if this
        fails, the instance frees it at its expiry)."""
        aiohttp = aiohttp_module()
        try:
            async with self.session.post(prefilled.prefill_url + "/kv/release",
                                         json={"id": prefilled.share_id, "opened": prefilled.opened},
                                         timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            logger.warning("releasing KV share %s on %s failed: %s", prefilled.share_id, prefilled.prefill_url, exc)

    def _enter(self, backend: Backend) -> None:
        backend.in_flight += 1
        self.metrics.in_flight.labels(backend.url).set(backend.in_flight)

    def _leave(self, backend: Backend) -> None:
        backend.in_flight -= 1
        self.metrics.in_flight.labels(backend.url).set(backend.in_flight)


def build_router_app(config: RouterConfig, policy: RoutingPolicy | None = None) -> FastAPI:
    """The router app; ``app.state.router`` is its :class:`Router` (tests read its state)."""
    aiohttp_module()
    router = Router(config, policy)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="deepinfer router", summary="cache-aware routing over OpenAI-compatible replicas",
                  lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward("POST", "/v1/completions", request, routed=True)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.forward("POST", "/v1/chat/completions", request, routed=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.forward("GET", "/v1/models", request, routed=False)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.forward("POST", "/tokenize", request, routed=False)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.forward("POST", "/detokenize", request, routed=False)

    @app.get("/health")
    async def health() -> Response:
        if any(b.healthy for b in router.backends.values()) and (
                not router.prefills or any(b.healthy for b in router.prefills.values())):
            return Response(status_code=200)
        return error_response(503, router.unhealthy_message())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
