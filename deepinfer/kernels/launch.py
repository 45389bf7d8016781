"""What the kernels' launchers share: the device's SM count, by which they size grids and K or
key splits, and the zeroed tile counters of split-K GEMMs (``fp8_gemm``, the batch-invariant
matmul) and of ``hyper_connection``'s split reductions, whose last program of a tile adds the
slices and zeroes its counter again."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

INTERPRETER_SMS = 132
"""The SM count launch choices are made for off CUDA (Triton's interpreter): an H100's / H200's."""

_counters: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
# Sets allocated while a CUDA graph was being captured: their zeroing was only recorded into
# that graph (nothing runs during a capture), so until zero_captured_counters() they hold
# whatever the graph pool's memory held.
_captured: list[torch.Tensor] = []


@functools.cache
def sm_count(device: torch.device, interpreter: int = INTERPRETER_SMS) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``interpreter`` elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return interpreter


def _stream_key(device: torch.device) -> tuple[torch.device, int]:
    return device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` zeroed int32 counters for split K, one set per (device, stream): GEMMs on
    one stream run one after another, and the last program of each tile zeroes its counter again.
    A larger set supersedes a smaller one; the smaller stays allocated, since a CUDA graph captured
    with it still uses it. A CUDA-graph capture stream gets its set within its first capture (the
    zeroing is then part of that graph, so captures go through :func:`graph_capture`, which
    zeroes it for real before any replay: another graph sharing the set may replay first)."""
    held = _counters.setdefault(_stream_key(device), [])
    if not held or held[-1].numel() < tiles:
        size = max(tiles, 2 * held[-1].numel() if held else 1024)
        counters = torch.zeros(size, dtype=torch.int32, device=device)
        if _capturing(device):
            _captured.append(counters)
        held.append(counters)
    return held[-1]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def zero_captured_counters() -> None:
    """Zero the counter sets allocated during CUDA-graph captures since the last call, for real
    (outside any capture, on the current stream): graphs of one capture stream share its set,
    and one that did not allocate it would otherwise count from the pool memory's old contents.
    :func:`graph_capture` calls it after each capture, before any replay."""
    while _captured:
        _captured.pop().zero_()


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph, pool: Any = None) -> Iterator[None]:
    """``torch.cuda.graph(graph, pool=pool)``, then the counter sets the capture allocated
    zeroed for real (:func:`zero_captured_counters`): how the engine captures its graphs."""
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        zero_captured_counters()
