"""Drives one :class:`Engine` from a dedicated thread for an asyncio server.

The engine is not thread-safe, so exactly one thread touches it: the engine
thread below. The event loop talks to it through a command queue (add, abort,
call) and gets results back through ``loop.call_soon_threadsafe``: each request's
``RequestOutput`` objects go to the asyncio queue given when it was added. While
requests are in flight the thread steps the engine back to back, running the
commands that arrived in between; when idle it sleeps on the command queue.
Per-request latency metrics are measured here, where outputs appear.

What does not belong here: HTTP, OpenAI shapes, tokenisation of user input.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

from deepinfer.engine.engine import Engine
from deepinfer.entrypoints.openai.metrics import ServerMetrics
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# An item on a request's queue: its next output, or the error that ended the engine.
QueueItem = RequestOutput | BaseException


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a fault escaped ``Engine.step`` or the server shut down)."""


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one in-flight request."""

    out: asyncio.Queue
    arrival: float
    num_prompt_tokens: int
    tokens_seen: list[int] = field(default_factory=list)   # per sequence
    last_token_at: float | None = None                      # None until the first token


@dataclass
class _Command:
    """Work for the engine thread; ``done`` (if any) receives its result or exception."""

    fn: Callable[[], Any]
    done: concurrent.futures.Future | None = None

    def run(self) -> None:
        if self.done is None:
            try:
                self.fn()
            except Exception:
                logger.exception("engine command failed")
            return
        if not self.done.set_running_or_notify_cancel():
            return    # its caller stopped waiting
        try:
            self.done.set_result(self.fn())
        except BaseException as exc:   # handed to the awaiting coroutine
            self.done.set_exception(exc)


class AsyncEngine:
    """Owns the engine thread. ``start`` and the coroutines run on the event loop;
    ``abort`` may be called from anywhere (it only enqueues)."""

    def __init__(self, engine: Engine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[_Command | None] = queue.SimpleQueue()
        # Guards _closed so that no command is queued after the thread drained the queue.
        self._lock = threading.Lock()
        self._closed = False
        self._tracked: dict[str, _Tracked] = {}
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None

    # -- lifecycle (event loop thread) -----------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the engine thread; requests still in flight get EngineDeadError."""
        with self._lock:
            if not self._closed:
                self._commands.put(None)
        if self._thread.ident is not None:
            self._thread.join(timeout_s)

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine thread is not serving, or None while it is."""
        if self._dead is not None:
            return self._dead
        if self._closed or (self._loop is not None and not self._thread.is_alive()):
            return EngineDeadError("the engine thread is not running")
        return None

    # -- requests (event loop thread) --------------------------------------------------------------
    async def add_requests(self, requests: Sequence[tuple[str, list[int], SamplingParams]],
                           out: asyncio.Queue) -> None:
        """Queue ``(request_id, prompt_token_ids, params)`` requests whose outputs all go
        to ``out``; all or none are added. Raises ValueError (from the engine) for input
        it refuses, including a prompt that can never fit; with several requests the
        message names the failing one's position."""
        arrival = time.monotonic()

        def add() -> None:
            added: list[str] = []
            try:
                for i, (request_id, ids, params) in enumerate(requests):
                    try:
                        reason = self.engine.scheduler.check_fits(len(ids))
                        if reason is not None:
                            raise ValueError(reason)
                        self.engine.add_request(ids, params, request_id)
                    except ValueError as exc:
                        raise ValueError(f"prompt[{i}]: {exc}" if len(requests) > 1 else str(exc)) from exc
                    added.append(request_id)
                    self._tracked[request_id] = _Tracked(out=out, arrival=arrival,
                                                         num_prompt_tokens=len(ids),
                                                         tokens_seen=[0] * params.n)
            except BaseException:
                for request_id in added:
                    self.engine.abort(request_id)
                raise

        try:
            await self._submit(add)
        except asyncio.CancelledError:
            # The add may still run after the caller went away.
            for request_id, _, _ in requests:
                self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (a no-op once it has finished). Never blocks, so it is safe
        in ``finally`` blocks of cancelled tasks."""
        self._put(_Command(lambda: self.engine.abort(request_id)))

    async def call(self, fn: Callable[[Engine], T], timeout_s: float | None = None) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        return await asyncio.wait_for(self._submit(lambda: fn(self.engine)), timeout_s)

    async def _submit(self, fn: Callable[[], T]) -> T:
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self._put(_Command(fn, done)):
            raise EngineDeadError(f"the engine is not running: {self.dead_error}")
        return await asyncio.wrap_future(done)

    def _put(self, cmd: _Command) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._commands.put(cmd)
            return True

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._run_commands():
                outputs = self.engine.step() if self.engine.has_unfinished() else []
                # Gauges first, so that a client that got its last output sees them settled.
                self.metrics.observe_engine(self.engine)
                self._dispatch(outputs)
                if self.engine.dead is not None:   # a parallel worker died: nothing can run now
                    raise EngineDeadError(self.engine.dead)
        except BaseException as exc:
            logger.exception("the engine thread failed; the server can no longer generate")
            self._dead = exc
        finally:
            self._close()
            if self._dead is None:
                # The KV cache's tiers go to the disk tier, if any: a restarted server finds them.
                # The engine itself stays usable (its owner closes it).
                try:
                    self.engine.persist_tiers()
                except Exception:
                    logger.exception("writing the KV cache's tiers to disk at shutdown failed")

    def _run_commands(self) -> bool:
        """Run queued commands, waiting for one only while the engine is idle.
        Returns False once asked to stop."""
        if self.engine.has_unfinished():
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
        else:
            cmd = self._commands.get()
        while cmd is not None:
            cmd.run()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _close(self) -> None:
        """Refuse new commands, fail the queued ones and every request still waiting."""
        with self._lock:
            self._closed = True
        error = EngineDeadError(f"the engine stopped: {self._dead}" if self._dead is not None
                                else "the server is shutting down")
        self._deliver_threadsafe([(t.out, error) for t in self._tracked.values()])
        self._tracked.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd is not None and cmd.done is not None and cmd.done.set_running_or_notify_cancel():
                cmd.done.set_exception(error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        batch: list[tuple[asyncio.Queue, QueueItem]] = []
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            for c in out.outputs:
                # The engine keeps appending to this list; hand over a snapshot.
                if c.logprobs is not None:
                    c.logprobs = list(c.logprobs)
            self._observe(tracked, out, now)
            batch.append((tracked.out, out))
            if out.finished:
                del self._tracked[out.request_id]
        self._deliver_threadsafe(batch)

    def _observe(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        new_tokens = 0
        for c in out.outputs:
            new_tokens += len(c.token_ids) - tracked.tokens_seen[c.index]
            tracked.tokens_seen[c.index] = len(c.token_ids)
        m = self.metrics
        if new_tokens:
            if tracked.last_token_at is None:
                m.on_first_token(now - tracked.arrival, tracked.num_prompt_tokens)
            else:
                m.on_inter_token(now - tracked.last_token_at)
            tracked.last_token_at = now
            m.on_generation_tokens(new_tokens)
        if out.finished:
            m.on_finish(now - tracked.arrival, [c.finish_reason for c in out.outputs])

    def _deliver_threadsafe(self, batch: list[tuple[asyncio.Queue, QueueItem]]) -> None:
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:   # the event loop is closed: nobody is listening any more
            pass


def _deliver(batch: list[tuple[asyncio.Queue, QueueItem]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
