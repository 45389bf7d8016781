"""Host tensors that device kernels read in place: read-only file maps, and pinning them.

What belongs here: mapping bytes of a file as a read-only tensor, and making host tensors
readable by CUDA kernels (zero-copy over PCIe). What does not: deciding what lives on the
host (the model, e.g. ``layers/engram.py``) and reading checkpoints (``models/loader.py``).

A pinned (page-locked) host buffer is mapped into the GPU's address space at its host
address under unified virtual addressing (every 64-bit Linux CUDA system), so a kernel given
the host pointer reads host memory directly; Triton resolves a pointer argument through
``cuPointerGetAttribute``, which returns that address for pinned memory. Only what the kernel
loads crosses the bus.

:func:`pin_for_device` pins host tensors where they are when it can: it registers each
tensor's pages with the driver (``cuMemHostRegister``, read-only). For a read-only *shared*
file map (:func:`map_file`) the registered pages are the page cache's own: nothing is copied,
and the tables a model keeps on the host cost their size in RAM once. (A copy-on-write map,
as ``safetensors`` makes, would be unshared page by page by a long-term pin on recent Linux
kernels, i.e. copied.) Where the driver refuses the registration (no read-only registration
on this system, memory it cannot pin) the tensor is copied into pinned memory instead, and
the log says which happened. The registration goes through the driver API rather than
``torch.cuda.cudart().cudaHostRegister``: a refused runtime call leaves its error as the
thread's last CUDA error, which the next PyTorch kernel launch check would then raise.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import warnings
import weakref
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# cuMemHostRegister flags (cuda.h): usable from every context, mapped into the device's
# address space, read-only (the pin then takes no write access, so shared file pages stay the
# page cache's).
_CU_MEMHOSTREGISTER_PORTABLE = 0x01
_CU_MEMHOSTREGISTER_DEVICEMAP = 0x02
_CU_MEMHOSTREGISTER_READ_ONLY = 0x08


def map_file(path: str | Path, offset: int, nbytes: int, dtype: torch.dtype,
             shape: tuple[int, ...]) -> torch.Tensor:
    """Bytes ``[offset, offset + nbytes)`` of a file as a CPU tensor of ``dtype`` and ``shape``,
    backed by a read-only shared map of the file: nothing is read until used, the pages are
    the page cache's (shared with every process mapping the file), and the map lives as long
    as the tensor. Writing to the tensor faults (the map is read-only)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = 1
    for n in shape:
        count *= n
    if count * itemsize != nbytes:
        raise ValueError(f"{path}: {nbytes} bytes at offset {offset} do not hold a {dtype} tensor of shape {shape}")
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if offset + nbytes > size:
            raise ValueError(f"{path}: bytes [{offset}, {offset + nbytes}) lie past the end of the "
                             f"{size}-byte file")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        mapped = mmap.mmap(f.fileno(), offset + nbytes - start, access=mmap.ACCESS_READ, offset=start)
    with warnings.catch_warnings():
        # PyTorch warns that it cannot mark a tensor read-only; the map's protection enforces it.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes, offset=offset - start)
    if (offset - start) % itemsize:
        # A misaligned tensor cannot be viewed in place (never in files written by safetensors).
        raw = raw.clone()
    return raw.view(dtype).view(shape)


@functools.cache
def _libcuda() -> ctypes.CDLL:
    """The CUDA driver library PyTorch has loaded (dlopen returns the same instance)."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cuMemHostRegister_v2.restype = ctypes.c_int
    lib.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    lib.cuMemHostUnregister.restype = ctypes.c_int
    return lib


def _unregister(device: torch.device, addresses: list[int], tensors: list[torch.Tensor]) -> None:
    """Undo the registrations (``tensors`` is held only so that their memory outlives them)."""
    if not addresses:
        return
    torch.cuda.synchronize(device)          # no kernel may still read the pages
    lib = _libcuda()
    for address in addresses:
        lib.cuMemHostUnregister(ctypes.c_void_p(address))


class HostPin:
    """Host tensors made readable by ``device``'s kernels at their host addresses.

    ``tensors[i]`` is the i-th tensor given, pinned where it was (registered) or copied into
    pinned memory; ``how[i]`` says which: "registered", "copied", "pinned" (it already was),
    or "host" (``device`` is not CUDA: the tensor is used as it is). Registrations are undone
    when this object is collected; keep it as long as a kernel may read the tensors.
    """

    def __init__(self, tensors: list[torch.Tensor], device: torch.device) -> None:
        self.tensors: list[torch.Tensor] = []
        self.how: list[str] = []
        addresses: list[int] = []
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError(f"HostPin: tensors must be on the CPU, got one on {t.device}")
            pinned, how, address = _pin(t.contiguous(), device)
            self.tensors.append(pinned)
            self.how.append(how)
            if address is not None:
                addresses.append(address)
        finalizer = weakref.finalize(self, _unregister, device, addresses, list(self.tensors))
        # At exit the process's mappings go with it; the driver may already be shutting down.
        finalizer.atexit = False


def _register(t: torch.Tensor, device: torch.device, flags: int) -> tuple[int, int]:
    """cuMemHostRegister of the pages holding ``t``: (CUresult, the first page's address)."""
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    with torch.cuda.device(device):
        # Makes the device's primary context current on this thread for the driver call.
        torch.cuda.synchronize()
        status = _libcuda().cuMemHostRegister_v2(ctypes.c_void_p(start), end - start,
                                                 _CU_MEMHOSTREGISTER_PORTABLE | _CU_MEMHOSTREGISTER_DEVICEMAP | flags)
    return status, start


def _pin(t: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, str, int | None]:
    """(the tensor readable by ``device``, how, the registered address or None)."""
    if device.type != "cuda":
        return t, "host", None
    if t.numel() == 0 or t.is_pinned():
        return t, "pinned", None
    status, address = _register(t, device, _CU_MEMHOSTREGISTER_READ_ONLY)
    if status == 0:
        return t, "registered", address
    nbytes = t.numel() * t.element_size()
    logger.info("cuMemHostRegister refused to pin %d bytes of host memory in place (CUresult %d): "
                "pinning a copy", nbytes, status)
    # An anonymous map of our own (page-aligned pages nothing else registers; PyTorch's pinned
    # allocator would round a 98 GB table up to 128 GiB).
    copy = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(t.dtype).view(t.shape)
    copy.copy_(t)
    status, address = _register(copy, device, 0)
    if status != 0:
        raise RuntimeError(f"cuMemHostRegister could not pin {nbytes} bytes of host memory for {device} "
                           f"(CUresult {status}), neither in place nor as a copy")
    return copy, "copied", address
