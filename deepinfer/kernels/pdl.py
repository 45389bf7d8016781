"""Programmatic dependent launch (PDL) for the Triton kernels, Hopper and later.

Without it, a kernel on a stream starts only once the previous one has finished and
the launch machinery has caught up: about 1.5 us per kernel for back-to-back small
kernels in a CUDA graph on the H200. With it (the launch attribute
``programmaticStreamSerialization``), the next kernel is launched while this one runs
and waits inside, at ``griddepcontrol.wait``, until the previous grid has completed and
its writes are visible: about 1.05 us per kernel on the same chain
(``docs/BENCHMARKS.md``). Decode runs ~170 kernels a step, most of them small.

The contract every kernel launched with :func:`flags` keeps: :func:`enter` is its first
statement. The wait makes the kernel's reads and writes ordered after the previous
kernel, as a plain launch would; it is also what keeps the ordering transitive (a
kernel that has passed its wait implies that everything before it has completed).
The early ``launch_dependents`` only lets the next kernel be scheduled; that kernel
waits for this one's completion in turn.

``DEEPINFER_PDL=0`` switches it off (plain launches); it is off off CUDA and before sm_90.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from deepinfer import env

try:  # Triton >= 3.3 on NVIDIA
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton or another backend
    gdc_launch_dependents = gdc_wait = None

_OFF: dict[str, Any] = {"PDL": False}
_ON: dict[str, Any] = {"PDL": True, "launch_pdl": True}


@functools.cache
def _supported(index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(index) >= (9, 0)


def flags(device: torch.device) -> dict[str, Any]:
    """Launch keyword arguments for a kernel that calls :func:`enter` first: PDL on for
    CUDA devices of compute capability 9.0+ unless ``DEEPINFER_PDL=0``."""
    if device.type != "cuda" or not env.pdl_enabled():
        return _OFF
    return _ON if _supported(device.index if device.index is not None else torch.cuda.current_device()) else _OFF


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a kernel launched with :func:`flags`."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
