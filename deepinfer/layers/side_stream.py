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
own), and unless ``DEEPINFER_SIDE_STREAM=0``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deepinfer import env

MAX_TOKENS = 256

_streams: dict[int, torch.cuda.Stream] = {}


def fork(x: torch.Tensor) -> torch.cuda.Stream | None:
    """The side stream, made to wait for the current stream's work so far; None when
    ``x`` (the branch's input, [T, ...]) is not on CUDA, has more than :data:`MAX_TOKENS`
    rows, or the side stream is switched off."""
    if not x.is_cuda or x.shape[0] > MAX_TOKENS or not env.side_stream_enabled():
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    side = _streams.get(index)
    if side is None:
        side = _streams[index] = torch.cuda.Stream(device=index)
    side.wait_stream(torch.cuda.current_stream(index))
    return side


@contextlib.contextmanager
def on(side: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the block on ``side`` (inline when None)."""
    if side is None:
        yield
        return
    with torch.cuda.stream(side):
        yield


def join(side: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for the branch run on ``side`` (no-op when None)."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
