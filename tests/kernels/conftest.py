"""Kernel tests run the Triton kernels on CUDA when there is a device, and
otherwise in Triton's CPU interpreter (small shapes only).

TRITON_INTERPRET is set in tests/conftest.py, before any test module imports a
kernel (it is read when a kernel is decorated). The interpreter's limits shape the CPU sweep: it multiplies bfloat16 tiles as raw
integers (so ``tl.dot`` kernels are swept in float32 and float16 there, bfloat16
on the GPU) and its float32 -> bfloat16 casts truncate instead of rounding to
nearest (so bfloat16 outputs get a two-ulp tolerance on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

ON_CUDA = torch.cuda.is_available()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_CUDA else "cpu")


@pytest.fixture
def poison_empty(monkeypatch):
    """Fill every floating tensor from torch.empty / torch.empty_like with NaN, so an
    output element (or partial result) a kernel fails to write shows up as NaN."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(real_empty_like(*a, **k)))


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(graph, output) of ``fn`` captured once in a CUDA graph, after a warm-up call on a side
    stream (compiles the kernels and allocates what a first call allocates outside the capture).
    ``output`` holds the tensors each replay rewrites."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
