"""A second CUDA stream for independent branches of a small-batch forward.

At decode sizes most kernels of a layer are latency bound: a chain of small launches
(routing, the compressor and indexer) leaves the GPU's bandwidth mostly unused while it
runs. A branch that does not depend on that chain (the shared expert's gate/up GEMM
beside the routing and routed experts; the compressor and indexer beside the query
projection) runs on this stream at the same time:

    side = side_stream.fork(x)          # None: run the branch inline
    with side_stream.on(side):
        y = branch(...)
    ...main-stream work...
    side_stream.join(side)              # y is ready for the main stream

``fork`` makes the side stream wait for everything enqueued so far on the current stream;
``join`` makes the current stream wait for the branch. Both are stream events, so they
are captured into CUDA graphs as a fork and a join of the graph. Memory: the branch
allocates on the side stream; every later use of the side stream follows a ``fork``
(which orders it after the main stream's reads of those tensors), and the main stream
reads them only after ``join``, so the caching allocator never hands a block to one
stream while the other still uses it. A branch must not launch kernels that keep
device-global scratch state between launches (``hc_pre``'s block counters): two of those
would then run concurrently.

Only on CUDA, for at most :data:`MAX_TOKENS` tokens (prefill kernels fill the GPU on their
own; a branch that waits on something else than the GPU's compute, as DeepSeek-V4.1's
host-memory engram gathers wait on PCIe, lifts the cap with ``max_tokens=None``), and unless
``DEEPINFER_SIDE_STREAM=0``.

Results a branch leaves in a forward's memo (``ForwardContext.memo``, e.g. a slot table several
layers share) follow the same rule, and :class:`Memo` checks it: an entry written inside a
branch and read outside it (on the main stream, or on another lane) before the branch's
:func:`join` raises, instead of racing on the GPU only. :data:`LEDGER` keeps the branches'
writes and joins.

Lanes: each ``lane`` name is a stream of its own, so a long branch (the engram gathers, started
at the top of a forward and joined layers later) does not hold up the short ones queued behind
it. The memory rule above holds per lane. A branch can also be joined in parts:
``mark(side)`` records an event after what was enqueued so far, and ``join(event)`` waits for
that part only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deepinfer import env

MAX_TOKENS = 256

_streams: dict[tuple[int, str], torch.cuda.Stream] = {}


class Ledger:
    """Which branch is running, and which of its memo writes the main stream may read yet.

    Each write inside a branch gets the branch's next sequence number; :func:`mark` notes the
    number so far in its event, and :func:`join` makes every write up to it (or, joining the
    stream, all of them) readable elsewhere. Streams are only keys here (a test passes any
    hashable object)."""

    def __init__(self) -> None:
        self.running: list[object] = []            # the branches whose ``on`` blocks are open, innermost last
        self.written: dict[object, int] = {}       # stream -> writes so far
        self.joined: dict[object, int] = {}        # stream -> writes the main stream has waited for

    def current(self) -> object | None:
        return self.running[-1] if self.running else None

    def write(self) -> tuple[object, int] | None:
        """The tag of a memo write made now: None on the main stream."""
        side = self.current()
        if side is None:
            return None
        self.written[side] = self.written.get(side, 0) + 1
        return side, self.written[side]

    def check_read(self, key: object, tag: tuple[object, int] | None) -> None:
        if tag is None:
            return
        side, seq = tag
        if side is not self.current() and seq > self.joined.get(side, 0):
            raise RuntimeError(f"side_stream: memo entry {key!r} was written on a side stream and read "
                               "outside it before side_stream.join: on a GPU the read would race the write")

    def join(self, side: object, upto: int | None = None) -> None:
        done = self.written.get(side, 0) if upto is None else upto
        self.joined[side] = max(self.joined.get(side, 0), done)


LEDGER = Ledger()


class Memo(dict):
    """A forward's memo of shared results (``ForwardContext.memo``): a dict whose entries written
    inside a side-stream branch can be read outside it only after that branch's :func:`join`
    (checked by :data:`LEDGER`; on the CPU no branch runs, so nothing is tagged)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._tags: dict[object, tuple[object, int] | None] = {}

    def __setitem__(self, key, value) -> None:
        self._tags[key] = LEDGER.write()
        super().__setitem__(key, value)

    def __getitem__(self, key):
        value = super().__getitem__(key)
        LEDGER.check_read(key, self._tags.get(key))
        return value

    def get(self, key, default=None):
        return self[key] if key in self else default

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def clear(self) -> None:
        self._tags.clear()
        super().clear()


def fork(x: torch.Tensor, max_tokens: int | None = MAX_TOKENS, lane: str = "branch") -> torch.cuda.Stream | None:
    """The side stream of ``lane``, made to wait for the current stream's work so far; None
    when ``x`` (the branch's input, [T, ...]) is not on CUDA, has more than ``max_tokens``
    rows (None: no cap), or the side stream is switched off."""
    if not x.is_cuda or (max_tokens is not None and x.shape[0] > max_tokens) or not env.side_stream_enabled():
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    side = _streams.get((index, lane))
    if side is None:
        side = _streams[index, lane] = torch.cuda.Stream(device=index)
    side.wait_stream(torch.cuda.current_stream(index))
    return side


def mark(side: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    """An event after the work enqueued on ``side`` so far (None when side is None)."""
    if side is None:
        return None
    event = torch.cuda.Event()
    event.record(side)
    event.deepinfer_part = (side, LEDGER.written.get(side, 0))      # the writes join(event) covers
    return event


@contextlib.contextmanager
def on(side: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the block on ``side`` (inline when None)."""
    if side is None:
        yield
        return
    LEDGER.running.append(side)
    try:
        with torch.cuda.stream(side):
            yield
    finally:
        LEDGER.running.pop()


def join(side: torch.cuda.Stream | torch.cuda.Event | None) -> None:
    """Make the current stream wait for the branch run on ``side``, or for the part of it
    before a :func:`mark` event (no-op when None)."""
    if isinstance(side, torch.cuda.Event):
        torch.cuda.current_stream().wait_event(side)
        LEDGER.join(*side.deepinfer_part)
    elif side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
        LEDGER.join(side)
