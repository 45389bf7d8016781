"""Same-host KV hand-over for prefill/decode disaggregation: the blocks stay in memory both
instances can map, and only a handle crosses HTTP.

What belongs here: the staging buffer a prefill instance fills with an export's blocks, the
handle that names it, opening that handle in another process, and the buffer's lifetime.
What does not: which blocks (engine/kv_transfer.py), HTTP (entrypoints/openai/kv_routes.py).

Two kinds of buffer, by the prefill engine's device:

- ``cuda_ipc`` (CUDA): a device tensor shared by CUDA IPC (``cudaIpcGetMemHandle`` through
  PyTorch's storage sharing); the decode instance maps it and copies the blocks from it, so
  the bytes never leave the GPUs (same device, or a peer device of the host). Both processes
  must see the device under the same index (the same ``CUDA_VISIBLE_DEVICES`` order).
- ``shm`` (CPU): a POSIX shared-memory segment (``multiprocessing.shared_memory``).

The handle is plain JSON (names, sizes, hex bytes), never a pickle, so an import cannot run
code. Lifetime: the prefill instance keeps each staged buffer in a :class:`ShareRegistry`
until the router releases it (after the decode instance's import, saying whether that
instance opened it) or until ``ttl_s`` passes. A decode instance refuses a handle past its
expiry. On CUDA, PyTorch counts the opened mappings: memory is freed once the prefill
instance has dropped its tensor and every opener has closed its mapping; a buffer nobody
opened is released with its count (``release(opened=False)``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

logger = logging.getLogger(__name__)

KINDS = ("cuda_ipc", "shm")
DEFAULT_TTL_S = 120.0

# Segments this process created (it owns them: its unlink unregisters them).
_CREATED: set[str] = set()


class ShareError(ValueError):
    """A handle this process cannot open (another host, another device set, expired)."""


@dataclass
class Staged:
    """One export's staging buffer, held by the prefill instance."""

    id: str
    tensor: torch.Tensor                     # uint8, the blocks back to back
    handle: dict[str, Any]                   # what an opener needs (JSON)
    expires: float                           # time.time() after which it is released
    shm: shared_memory.SharedMemory | None = None


def _stage_cuda(nbytes: int, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    (dev, handle, size, offset, ref_handle, ref_offset,
     event_handle, event_sync) = tensor.untyped_storage()._share_cuda_()
    return tensor, {"kind": "cuda_ipc", "device": int(dev), "handle": handle.hex(), "storage_bytes": int(size),
                    "storage_offset": int(offset), "ref_handle": ref_handle.hex(), "ref_offset": int(ref_offset),
                    "event_handle": event_handle.hex() if event_handle else "", "event_sync": bool(event_sync)}


def _stage_shm(nbytes: int) -> tuple[torch.Tensor, dict[str, Any], shared_memory.SharedMemory]:
    shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    _CREATED.add(shm._name)  # type: ignore[attr-defined]
    tensor = torch.frombuffer(shm.buf, dtype=torch.uint8)
    return tensor, {"kind": "shm", "name": shm.name}, shm


class ShareRegistry:
    """The staged buffers a prefill instance holds for decode instances to open."""

    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._staged: dict[str, Staged] = {}
        self.staged_total = 0                 # buffers staged since start
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._staged)

    def stage(self, nbytes: int, device: torch.device) -> Staged:
        """A new buffer of ``nbytes`` on ``device`` (CUDA: its memory; CPU: shared memory),
        registered until released or expired. Expired buffers are released first."""
        self.expire()
        sid = uuid.uuid4().hex
        expires = time.time() + self.ttl_s
        if device.type == "cuda":
            tensor, handle = _stage_cuda(nbytes, device)
            staged = Staged(sid, tensor, handle, expires)
        else:
            tensor, handle, shm = _stage_shm(nbytes)
            staged = Staged(sid, tensor, handle, expires, shm)
        staged.handle.update(id=sid, nbytes=int(nbytes), expires=expires)
        with self._lock:
            self._staged[sid] = staged
            self.staged_total += 1
        return staged

    def release(self, sid: str, opened: bool) -> bool:
        """Drop buffer ``sid``; ``opened`` says whether a decode instance mapped it (a CUDA
        buffer nobody mapped gives back the count PyTorch holds for its opener). False when
        no such buffer is held (released or expired already)."""
        with self._lock:
            staged = self._staged.pop(sid, None)
        if staged is None:
            return False
        _free(staged, opened)
        return True

    def expire(self, now: float | None = None) -> int:
        """Release every buffer past its expiry; how many. A CUDA buffer that expires
        unreleased is assumed opened (its decode instance had until then): were it never
        opened, its memory stays mapped until this process exits."""
        now = time.time() if now is None else now
        with self._lock:
            old = [s for s in self._staged.values() if s.expires <= now]
            for s in old:
                del self._staged[s.id]
        for s in old:
            logger.warning("KV share %s expired unreleased after %.0f s; released", s.id, self.ttl_s)
            _free(s, opened=True)
        return len(old)

    def close(self) -> None:
        """Release everything (server shutdown)."""
        with self._lock:
            held = list(self._staged.values())
            self._staged.clear()
        for s in held:
            _free(s, opened=True)


def _free(staged: Staged, opened: bool) -> None:
    if staged.shm is not None:
        del staged.tensor                     # the exported buffer view must go before close()
        staged.shm.close()
        _CREATED.discard(staged.shm._name)  # type: ignore[attr-defined]
        try:
            staged.shm.unlink()
        except FileNotFoundError:
            pass
        return
    h = staged.handle
    if not opened:
        torch.UntypedStorage._release_ipc_counter(bytes.fromhex(h["ref_handle"]), h["ref_offset"],
                                                  device=h["device"])
    del staged.tensor


class Opened:
    """A decode instance's mapping of a staged buffer; ``close()`` unmaps it."""

    def __init__(self, handle: dict[str, Any]) -> None:
        kind = handle.get("kind")
        if kind not in KINDS:
            raise ShareError(f"KV share handle kind {kind!r}: this engine opens {', '.join(KINDS)}")
        if float(handle.get("expires", 0)) <= time.time():
            raise ShareError("KV share handle has expired: the prefill instance may have freed its buffer")
        self.nbytes = int(handle["nbytes"])
        self.tensor: torch.Tensor | None = None
        self._shm: shared_memory.SharedMemory | None = None
        if kind == "shm":
            try:
                self._shm = shared_memory.SharedMemory(name=str(handle["name"]))
            except FileNotFoundError as exc:
                raise ShareError(f"KV share segment {handle['name']!r} does not exist on this host "
                                 "(another host, or released)") from exc
            # Opening registers the segment with this process's resource tracker, which would
            # unlink it at exit; the prefill instance owns it (unless that is this process).
            if self._shm._name not in _CREATED:  # type: ignore[attr-defined]
                resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
            if self._shm.size < self.nbytes:
                self.close()
                raise ShareError(f"KV share segment is {self._shm.size} bytes, its handle says {self.nbytes}")
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8)[:self.nbytes]
        else:
            if not torch.cuda.is_available() or int(handle["device"]) >= torch.cuda.device_count():
                raise ShareError(f"KV share is on CUDA device {handle['device']}, which this process does not see")
            torch.cuda._lazy_init()
            storage = torch.UntypedStorage._new_shared_cuda(
                int(handle["device"]), bytes.fromhex(handle["handle"]), int(handle["storage_bytes"]),
                int(handle["storage_offset"]), bytes.fromhex(handle["ref_handle"]), int(handle["ref_offset"]),
                bytes.fromhex(handle["event_handle"]) if handle["event_handle"] else None,
                bool(handle["event_sync"]))
            self.tensor = torch.empty(0, dtype=torch.uint8, device=f"cuda:{handle['device']}").set_(storage)
            self.tensor = self.tensor[:self.nbytes]

    def close(self) -> None:
        if self.tensor is not None and self.tensor.is_cuda:
            torch.cuda.synchronize(self.tensor.device)
        self.tensor = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
