"""Session-wide test setup.

Triton reads TRITON_INTERPRET when a kernel is decorated (its module's first
import), and any test module may import one, so the CPU interpreter is switched on
here, before collection imports anything. On a CUDA machine kernels compile for
the device. After each module the heap its engines freed goes back to the OS.
"""

import ctypes
import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="module")
def release_memory_after_module():
    """After each test module: collect its engines' reference cycles and give the freed heap
    back to the OS, so one pytest process does not keep every module's peak resident."""
    yield
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()
