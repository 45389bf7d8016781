"""The KV host tier's memory: fixed-size entry buffers carved from a few large chunks.

What belongs here: holding the host tier's bytes (which buffer a slot's entry lives in, the
free buffers, the bytes held and their limit, moving entries to free a chunk). What does
not: what the bytes are or when they move (runner/kv_offload.py), which entries the tier
keeps (scheduler/kv_tiers.py).

Memory is taken in chunks of ``chunk_bytes`` (a power of two: PyTorch's pinned-memory
allocator rounds every request up to one, so a chunk costs exactly its size), pinned on
CUDA so copies to and from the device are DMA transfers, plain elsewhere. Chunks are taken
lazily, when no free buffer of the wanted size is left, and kept for the engine's life (a
``cudaHostAlloc`` is slow and a ``cudaFreeHost`` synchronizes the device). A chunk serves one
entry size at a time: it is carved into ``chunk_bytes // stride`` buffers (``stride``: the
size rounded up to ``ALIGN``); a chunk whose buffers are all free is carved again for
another size when that size needs one.

Limit, and what happens when full. The tier index (``TierIndex``) keeps the entries' bytes
within the host budget ``capacity``; the store runs the index's ops in order, so once the
evictions queued before a save (or import) have run, the entries held are at most
``capacity``. With ``k`` entry sizes, ``max_chunks = capacity // c + k`` chunks (``c``: the
fewest entry bytes one chunk holds, i.e. the chunk less its tail and stride padding) then
always have room for one more entry: when every chunk is taken and no buffer of the wanted
size is free, some size has a whole chunk's worth of free buffers (else the chunks would
number fewer), so packing that size empties one of its chunks. The memory held is thus at
most the budget (grown by the padding, under one stride per chunk) plus ``k`` chunks, and
:func:`default_chunk_bytes` keeps ``k`` chunks within 256 MiB, or within the budget when
smaller (16 MiB at least). When no buffer is free and no chunk may be taken,
:meth:`HostSlab.alloc` returns None; the caller then lets the queued evictions run and calls
:meth:`HostSlab.compact`, which moves the entries of the emptiest chunk of some size into
free buffers of that size's other chunks and carves the emptied chunk for the wanted size.
A caller that holds more than the index allows fails loudly there instead of allocating.

Thread safety: every method takes the slab's lock (saves allocate on the launching thread,
the worker thread frees). :meth:`compact` moves bytes: the caller must make sure no copy
into or out of a buffer is in flight.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

ALIGN = 256                       # buffer stride alignment (bytes): DMA-friendly offsets
MAX_CHUNK_BYTES = 256 << 20
MIN_CHUNK_BYTES = 16 << 20


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def default_chunk_bytes(capacity: int, sizes: Sequence[int]) -> int:
    """The chunk size for a tier of ``capacity`` bytes holding entries of ``sizes``: one
    chunk per distinct size fits in 256 MiB, or in the capacity when smaller (16 MiB at
    least, so a save on its way to disk does not wait for the previous one), a power of
    two, and at least the largest entry."""
    kinds = len(set(sizes))
    share = min(MAX_CHUNK_BYTES, max(capacity, MIN_CHUNK_BYTES)) // kinds
    return max(_pow2_floor(share), _pow2_ceil(_stride(max(sizes))))


def _stride(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


class _Chunk:
    """One chunk carved into ``count`` buffers of ``size`` bytes, ``stride`` apart."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.size = self.stride = self.count = 0
        self.free: list[int] = []               # buffer indices
        self.slots: dict[int, int] = {}         # buffer index -> slot

    def carve(self, size: int) -> None:
        self.size, self.stride = size, _stride(size)
        self.count = self.data.numel() // self.stride
        self.free = list(range(self.count - 1, -1, -1))     # pop() takes the lowest first
        self.slots = {}

    def view(self, index: int) -> torch.Tensor:
        return self.data[index * self.stride:index * self.stride + self.size]


class HostSlab:
    """Host buffers for entries of ``sizes`` bytes within ``capacity`` bytes of entries (see
    the module docstring). ``views[slot]``: the uint8 buffer of ``slot``'s entry."""

    def __init__(self, sizes: Sequence[int], capacity: int, pinned: bool, chunk_bytes: int | None = None) -> None:
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"entry sizes must be positive, got {list(sizes)}")
        if capacity < 0:
            raise ValueError(f"host tier capacity must be >= 0, got {capacity}")
        self.chunk_bytes = default_chunk_bytes(capacity, sizes) if chunk_bytes is None else chunk_bytes
        if self.chunk_bytes & (self.chunk_bytes - 1):
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must be a power of two")
        if self.chunk_bytes < _stride(max(sizes)):
            raise ValueError(f"chunk_bytes={self.chunk_bytes} must hold the largest entry ({max(sizes)} bytes, "
                             f"{_stride(max(sizes))} aligned)")
        self.pinned = pinned
        self.sizes = sorted(set(sizes))
        fewest = min((self.chunk_bytes // _stride(s)) * s for s in self.sizes)
        self.max_chunks = capacity // fewest + len(self.sizes)
        self.views: dict[int, torch.Tensor] = {}
        self.num_packed = 0                                   # chunks emptied by compact()
        self._chunks: list[_Chunk] = []
        self._by_size: dict[int, list[_Chunk]] = {s: [] for s in self.sizes}
        self._open: dict[int, dict[_Chunk, None]] = {s: {} for s in self.sizes}   # chunks with a free buffer
        self._where: dict[int, tuple[_Chunk, int]] = {}      # slot -> its chunk and buffer
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        """Host memory taken (every chunk, used or not)."""
        return len(self._chunks) * self.chunk_bytes

    @property
    def limit_bytes(self) -> int:
        return self.max_chunks * self.chunk_bytes

    def num_free(self, size: int) -> int:
        """Free buffers of ``size`` bytes in the chunks carved for it."""
        with self._lock:
            return sum(len(c.free) for c in self._by_size[size])

    def num_buffers(self, size: int) -> int:
        with self._lock:
            return sum(c.count for c in self._by_size[size])

    def alloc(self, slot: int, size: int) -> torch.Tensor | None:
        """A buffer of ``size`` bytes for ``slot`` (also ``views[slot]``), or None when none is
        free and the limit allows no new chunk."""
        if size not in self._by_size:
            raise ValueError(f"no host tier entries of {size} bytes (sizes {self.sizes})")
        if slot in self.views:
            raise ValueError(f"host tier slot {slot} is held already")
        with self._lock:
            chunk = self._chunk_with_room(size)
            if chunk is None:
                return None
            return self._place(slot, chunk)

    def free(self, slot: int) -> None:
        """Give ``slot``'s buffer back."""
        with self._lock:
            chunk, index = self._where.pop(slot)
            del self.views[slot]
            del chunk.slots[index]
            chunk.free.append(index)
            self._open[chunk.size][chunk] = None

    def compact(self, size: int) -> bool:
        """Empty one chunk for ``size`` by moving the entries of the emptiest chunk of some
        size (one whose other chunks have the free buffers to take them) into those buffers,
        and carve it for ``size``. False when no chunk can be emptied. ``views`` of moved
        slots change; nothing may be copying into or out of a buffer meanwhile."""
        with self._lock:
            best = None
            for s, chunks in self._by_size.items():
                free_total = sum(len(c.free) for c in chunks)
                for c in chunks:
                    if len(c.slots) <= free_total - len(c.free) and (best is None or len(c.slots) < len(best.slots)):
                        best = c
            if best is None:
                return False
            others = [c for c in self._by_size[best.size] if c is not best and c.free]
            for index, slot in list(best.slots.items()):
                while not others[-1].free:
                    others.pop()
                dst = others[-1]
                new = dst.free.pop()
                if not dst.free:
                    del self._open[dst.size][dst]
                dst.view(new).copy_(best.view(index))
                dst.slots[new] = slot
                self._where[slot] = (dst, new)
                self.views[slot] = dst.view(new)
            best.slots.clear()
            self._recarve(best, size)
            self.num_packed += 1
            return True

    def _chunk_with_room(self, size: int) -> _Chunk | None:
        for c in self._open[size]:
            return c
        for c in self._chunks:             # an empty chunk of another size
            if not c.slots and c.size != size:
                self._recarve(c, size)
                return c
        if len(self._chunks) >= self.max_chunks:
            return None
        with torch.inference_mode(False):     # an inference tensor could not be written outside the mode
            c = _Chunk(torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self.pinned))
        self._chunks.append(c)
        self._recarve(c, size)
        return c

    def _recarve(self, chunk: _Chunk, size: int) -> None:
        if chunk.size:
            self._by_size[chunk.size].remove(chunk)
            self._open[chunk.size].pop(chunk, None)
        chunk.carve(size)
        self._by_size[size].append(chunk)
        self._open[size][chunk] = None

    def _place(self, slot: int, chunk: _Chunk) -> torch.Tensor:
        index = chunk.free.pop()
        if not chunk.free:
            del self._open[chunk.size][chunk]
        chunk.slots[index] = slot
        self._where[slot] = (chunk, index)
        view = self.views[slot] = chunk.view(index)
        return view
