"""Byte movement of the KV cache's lower tiers: device pages <-> host memory <-> disk files.

What belongs here: carrying out the scheduler's ``TierOp``s (scheduler/plan.py) on the KV
buffer, the host copies and the disk files; the disk format and its checks; the scan that
finds a disk tier again when an engine starts; transfer counters. What does not: which
blocks live in which tier (scheduler/kv_tiers.py).

An entry is the bytes ``[0, group.bytes_per_block)`` of one page: one group's part of a
block, every layer of the group (runner/model_runner.py lays pages out so). Saves run at
once on the launching thread, before the step's block copies and forward can overwrite the
evicted blocks (on CUDA: a non-blocking copy into a pinned slab buffer on the current
stream, with an event the readers wait for). Every other op runs on one worker thread, in
order, so disk writes and reads, and loads, overlap the step's forward; a step's loads are
copied as one batch (on CUDA back to back on a side stream, waited for once) and are done
when ``wait`` returns for it. Host copies live in a slab of a few large chunks
(runner/kv_host_slab.py): no allocation per entry once the tier has grown.

Disk format: one file per entry, ``<key hex>.kvblock``, written to a temporary name and
renamed (a reader sees a whole file or none): ``MAGIC``, a little-endian uint32 header
length, a JSON header (format version, the engine's fingerprint, the group and its
layout, the entry's keys, the payload's size and SHA-256), then the payload. A file whose
header does not parse, whose fingerprint or layout differs, or whose size is not the
header's is ignored by the scan; a payload whose checksum fails is never written to the
device, and its file is deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from deepinfer.config import EngineConfig
from deepinfer.runner.kv_host_slab import HostSlab
from deepinfer.scheduler.kv_cache import KVCacheGroup
from deepinfer.scheduler.kv_tiers import TierEntry
from deepinfer.scheduler.plan import TierOp

logger = logging.getLogger(__name__)

MAGIC = b"DIKVBLK1"
FORMAT_VERSION = 1
SUFFIX = ".kvblock"
_LEN = struct.Struct("<I")

# Transfer directions counted in TransferStats.
DIRECTIONS = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_device")


def group_layout(group: KVCacheGroup) -> dict:
    """What a group's part of a page holds, as plain data (the disk header and fingerprint)."""
    return {"kind": group.kind, "block_size": group.block_size, "sliding_window": group.sliding_window,
            "compress_ratio": group.compress_ratio, "bytes_per_block": group.bytes_per_block,
            "layers": list(group.layer_ids),
            "specs": [[str(s.dtype), s.num_tensors, s.num_kv_heads, s.head_size, s.record] for s in group.specs]}


def config_fingerprint(config: EngineConfig, groups: Sequence[KVCacheGroup]) -> str:
    """What must be equal for a disk entry to be valid in this engine: the model (its
    config.json, checkpoint path, dtypes, KV format; the seed of random weights) and the
    cache layout."""
    model = config.model
    data = {"path": model.path, "hf_config": model.hf_config, "dtype": str(model.dtype),
            "kv_cache_dtype": model.kv_cache_dtype, "load_format": model.load_format,
            "seed": config.seed if model.load_format == "dummy" else None,
            "groups": [group_layout(g) for g in groups]}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class TransferStats:
    """Bytes moved and seconds of transfer per direction (``DIRECTIONS``), cumulative: the
    copies' own time (``KVTierStore`` says how each is timed), not the ops' bookkeeping."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))

    def bandwidth(self, direction: str) -> float:
        """Bytes per second in ``direction`` (0 before anything moved)."""
        s = self.seconds[direction]
        return self.bytes[direction] / s if s > 0 else 0.0


@dataclass
class _SaveBatch:
    """CUDA: the saves of one ``execute`` call issued since its last event."""

    start: torch.cuda.Event | None = None
    slots: list[int] = field(default_factory=list)
    nbytes: int = 0


def read_header(path: Path) -> dict | None:
    """A disk entry's header, or None when the file is not a whole entry."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + _LEN.size)
            if len(head) != len(MAGIC) + _LEN.size or head[:len(MAGIC)] != MAGIC:
                return None
            (n,) = _LEN.unpack(head[len(MAGIC):])
            header = json.loads(f.read(n).decode())
        if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
            return None
        if path.stat().st_size != len(MAGIC) + _LEN.size + n + int(header["nbytes"]):
            return None        # truncated (or grown)
        header["offset"] = len(MAGIC) + _LEN.size + n
        return header
    except (OSError, ValueError, KeyError, UnicodeDecodeError):
        return None


class KVTierStore:
    """The lower tiers' bytes for one KV buffer ``[num_blocks, page_bytes]`` (uint8).

    Host memory: ``host[slot]`` is a view into a :class:`HostSlab` (runner/kv_host_slab.py):
    pinned chunks on CUDA, plain memory elsewhere, within ``host_bytes`` (the host tier's
    budget, ``CacheConfig.kv_offload_bytes``) plus the slab's chunk slack. A save or import
    that finds no free buffer first lets the queued ops run (the index's evictions free
    buffers), then packs the slab; it raises only if the caller holds more than the index
    allows. ``chunk_bytes`` overrides the slab's chunk size.

    Loads: the copies of one ``execute`` call's loads are issued back to back (on CUDA on a
    side stream) and waited for once. ``stats`` counts transfer time only: a save batch's
    GPU time between its events, a load batch's time from its first copy to its completion
    (a disk load also counts its read and checksum)."""

    def __init__(self, kv_buffer: torch.Tensor, groups: Sequence[KVCacheGroup], fingerprint: str,
                 disk_dir: str | None, host_bytes: int = 0, chunk_bytes: int | None = None) -> None:
        self.kv_buffer = kv_buffer
        self.groups = list(groups)
        self.fingerprint = fingerprint
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self.cuda = kv_buffer.device.type == "cuda"
        self.slab = HostSlab([g.bytes_per_block for g in self.groups], host_bytes, pinned=self.cuda,
                             chunk_bytes=chunk_bytes)
        self.host: dict[int, torch.Tensor] = self.slab.views  # slot -> bytes (a view into the slab)
        self._ready: dict[int, torch.cuda.Event] = {}        # CUDA: slot -> its save batch's event
        self._stream = torch.cuda.Stream(kv_buffer.device) if self.cuda else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-tiers")
        self._pending: list[Future] = []
        self._importing = False
        self._lock = threading.Lock()
        self._stats = TransferStats()
        self._save_timing: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []  # CUDA: unread save batches
        self._staging = torch.empty(0, dtype=torch.uint8)   # disk reads, reused by each load batch

    @property
    def stats(self) -> TransferStats:
        """Bytes and transfer seconds per direction (save batches finished on the GPU so far)."""
        self._count_saves()
        return self._stats

    def _count_saves(self) -> None:
        """CUDA: count the save batches the GPU has finished (their events' elapsed time)."""
        with self._lock:
            unread = []
            for start, end, nbytes in self._save_timing:
                if end.query():
                    self._stats.bytes["device_to_host"] += nbytes
                    self._stats.seconds["device_to_host"] += start.elapsed_time(end) / 1e3
                else:
                    unread.append((start, end, nbytes))
            self._save_timing = unread

    # -- start-up ----------------------------------------------------------------
    def scan(self) -> list[TierEntry]:
        """The disk tier's valid entries, least recently written first."""
        if self.disk_dir is None:
            return []
        found, ignored = [], 0
        for path in self.disk_dir.glob("*" + SUFFIX):
            header = read_header(path)
            if (header is None or header.get("fingerprint") != self.fingerprint
                    or not 0 <= header.get("group", -1) < len(self.groups)
                    or header.get("nbytes") != self.groups[header["group"]].bytes_per_block
                    or path.stem != header.get("key")):
                ignored += 1
                continue
            entry = TierEntry(bytes.fromhex(header["key"]), header["group"],
                              tuple(bytes.fromhex(k) for k in header["keys"]), header["nbytes"])
            found.append((path.stat().st_mtime_ns, entry))
        if ignored:
            logger.warning("KV disk tier %s: ignored %d files that are not whole entries of this model "
                           "and cache layout", self.disk_dir, ignored)
        logger.info("KV disk tier %s: %d entries", self.disk_dir, len(found))
        return [e for _, e in sorted(found, key=lambda t: t[0])]

    # -- ops ---------------------------------------------------------------------
    def execute(self, ops: Sequence[TierOp]) -> list[Future]:
        """Carry out a plan's ops: saves now, the rest queued on the worker in order (one
        task, whose loads are copied as one batch). Returns the futures of its loads (each
        gives the key whose load failed, or None)."""
        loads: list[Future] = []
        queued: list[tuple[TierOp, Future | None]] = []
        saves = _SaveBatch()
        for op in ops:
            if op.kind == "save":
                self._save(op, saves, queued)
            elif op.kind in ("demote", "drop", "load"):
                future = Future() if op.kind == "load" else None
                queued.append((op, future))
                if future is not None:
                    loads.append(future)
            else:
                raise ValueError(f"unknown KV tier op {op.kind!r}")
        self._end_saves(saves)
        self._submit(queued)
        self._pending = [f for f in self._pending if not f.done()]
        self._count_saves()
        return loads

    def put_host(self, slot: int, data: bytes | torch.Tensor) -> None:
        """Host-tier bytes for ``slot`` that came from another engine (scheduler/kv_tiers.py,
        ``TierIndex.imported``), as bytes or as a uint8 tensor on any device (a mapped
        same-host buffer): stored as a save's copy would be. Copies from a device are queued;
        :meth:`sync_imports` waits for them. The caller runs the index's ops of the import
        (its evictions) first, so the slab has room."""
        nbytes = len(data) if isinstance(data, (bytes, bytearray)) else data.numel()
        host = self._alloc(slot, nbytes, [])
        if isinstance(data, torch.Tensor):
            host.copy_(data, non_blocking=data.is_cuda)
            self._importing |= data.is_cuda
        else:
            host.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def sync_imports(self) -> None:
        """Wait for :meth:`put_host`'s queued device copies (before their source goes away)."""
        if self._importing:
            torch.cuda.synchronize()
            self._importing = False

    @staticmethod
    def wait(loads: Sequence[Future]) -> set[bytes]:
        """Wait for loads (``execute``'s futures); the keys of those that failed."""
        return {key for key in (f.result() for f in loads) if key is not None}

    def flush(self) -> None:
        """Wait for every queued op (disk writes included)."""
        for f in self._pending:
            f.result()
        self._pending = []

    def close(self) -> None:
        self.flush()
        self._worker.shutdown(wait=True)

    def _count(self, direction: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._stats.bytes[direction] += nbytes
            self._stats.seconds[direction] += seconds

    def _page_part(self, group: int, block: int) -> torch.Tensor:
        return self.kv_buffer[block, :self.groups[group].bytes_per_block]

    def _submit(self, queued: list[tuple[TierOp, Future | None]]) -> None:
        if queued:
            self._pending.append(self._worker.submit(self._run_batch, list(queued)))
            queued.clear()

    def _alloc(self, slot: int, nbytes: int, queued: list[tuple[TierOp, Future | None]],
               saves: _SaveBatch | None = None) -> torch.Tensor:
        """A slab buffer for ``slot``; when the slab is full, the ops queued before it run
        first (their drops and demotes free buffers), then the slab is packed."""
        host = self.slab.alloc(slot, nbytes)
        if host is not None:
            return host
        if saves is not None:
            self._end_saves(saves)          # the queued ops may read this call's saves
        self._submit(queued)
        self.flush()
        host = self.slab.alloc(slot, nbytes)
        if host is not None:
            return host
        if self.cuda:                       # packing moves buffers: no copy may be in flight
            torch.cuda.synchronize(self.kv_buffer.device)
            self._ready.clear()
            self._importing = False
        if self.slab.compact(nbytes):
            host = self.slab.alloc(slot, nbytes)
        if host is None:
            raise RuntimeError(f"KV host tier: no room for a {nbytes}-byte entry in {self.slab.held_bytes} bytes "
                               f"held (limit {self.slab.limit_bytes}): the store holds more entries than the "
                               f"tier index allows")
        return host

    def _save(self, op: TierOp, saves: _SaveBatch, queued: list[tuple[TierOp, Future | None]]) -> None:
        src = self._page_part(op.group, op.block)
        host = self._alloc(op.slot, src.numel(), queued, saves)
        if self.cuda:
            if saves.start is None:
                saves.start = torch.cuda.Event(enable_timing=True)
                saves.start.record()
            host.copy_(src, non_blocking=True)
            saves.slots.append(op.slot)
            saves.nbytes += src.numel()
        else:
            t0 = time.perf_counter()
            host.copy_(src)
            self._count("device_to_host", src.numel(), time.perf_counter() - t0)

    def _end_saves(self, saves: _SaveBatch) -> None:
        """Record the event the readers of ``saves``' slots wait for (CUDA), and start a new batch."""
        if saves.start is None:
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        for slot in saves.slots:
            self._ready[slot] = end
        with self._lock:
            self._save_timing.append((saves.start, end, saves.nbytes))
        saves.start, saves.slots, saves.nbytes = None, [], 0

    def _host_copy(self, slot: int) -> torch.Tensor:
        event = self._ready.pop(slot, None)
        if event is not None:
            event.synchronize()
        return self.host[slot]

    def _run_batch(self, ops: list[tuple[TierOp, Future | None]]) -> None:
        """One ``execute`` call's queued ops, in order. Loads are gathered, then copied back to
        back and waited for once; the buffers of drops and demotes are freed after that (a
        load of the batch may read one), and then the loads' futures are set."""
        copies: list[tuple[torch.Tensor, torch.Tensor, str]] = []     # (device part, source, direction)
        results: list[tuple[Future, bytes | None]] = []
        freed: list[int] = []
        disk_bytes = sum(self.groups[op.group].bytes_per_block for op, _ in ops
                         if op.kind == "load" and op.tier == "disk")
        staged = 0
        if disk_bytes > self._staging.numel():
            with torch.inference_mode(False):
                self._staging = torch.empty(1 << (disk_bytes - 1).bit_length(), dtype=torch.uint8,
                                            pin_memory=self.cuda)
        try:
            for op, future in ops:
                if op.kind == "demote":
                    data = self._host_copy(op.slot)
                    t0 = time.perf_counter()
                    try:
                        self._write_file(op, data)
                        self._count("host_to_disk", data.numel(), time.perf_counter() - t0)
                    except OSError as exc:
                        # The index counts the entry as on disk; loading it will find no file and
                        # report it failed, so the entry is forgotten then.
                        logger.warning("KV disk tier: writing entry %s failed (%s); it is lost", op.key.hex(), exc)
                    freed.append(op.slot)
                elif op.kind == "drop":
                    if op.tier == "host":
                        self._host_copy(op.slot)      # its save's copy lands before the buffer is reused
                        freed.append(op.slot)
                    else:
                        self._path(op.key).unlink(missing_ok=True)
                elif op.tier == "host":
                    copies.append((self._page_part(op.group, op.block), self._host_copy(op.slot), "host_to_device"))
                    results.append((future, None))
                else:
                    t0 = time.perf_counter()
                    size = self.groups[op.group].bytes_per_block
                    src = self._read_file(op, self._staging[staged:staged + size])
                    if src is None:
                        results.append((future, op.key))
                        continue
                    staged += size
                    self._count("disk_to_device", 0, time.perf_counter() - t0)
                    copies.append((self._page_part(op.group, op.block), src, "disk_to_device"))
                    results.append((future, None))
            self._copy_batch(copies)
        except BaseException as exc:
            for _, future in ops:
                if future is not None:
                    future.set_exception(exc)
            raise
        finally:
            for slot in freed:
                self.slab.free(slot)
        for future, key in results:
            future.set_result(key)

    def _copy_batch(self, copies: list[tuple[torch.Tensor, torch.Tensor, str]]) -> None:
        """Copy each source into its device part, back to back, and wait once; the batch's
        time is split between its directions by bytes."""
        if not copies:
            return
        t0 = time.perf_counter()
        if self.cuda:
            with torch.cuda.device(self.kv_buffer.device), torch.cuda.stream(self._stream):
                for dst, src, _ in copies:
                    dst.copy_(src, non_blocking=True)
            self._stream.synchronize()
        else:
            for dst, src, _ in copies:
                dst.copy_(src)
        seconds = time.perf_counter() - t0
        total = sum(src.numel() for _, src, _ in copies)
        for direction in ("host_to_device", "disk_to_device"):
            nbytes = sum(src.numel() for _, src, d in copies if d == direction)
            if nbytes:
                self._count(direction, nbytes, seconds * nbytes / total)

    # -- disk --------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.disk_dir / (key.hex() + SUFFIX)

    def _write_file(self, op: TierOp, data: torch.Tensor) -> None:
        payload = data.numpy().tobytes()
        header = json.dumps({
            "version": FORMAT_VERSION, "fingerprint": self.fingerprint, "key": op.key.hex(),
            "group": op.group, "layout": group_layout(self.groups[op.group]),
            "keys": [k.hex() for k in op.keys], "nbytes": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest()}).encode()
        path = self._path(op.key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(header)) + header + payload)
        os.replace(tmp, path)

    def _read_file(self, op: TierOp, out: torch.Tensor) -> torch.Tensor | None:
        """An entry's payload read into ``out`` (the group's entry size) and checked: ``out``,
        or None (and the file deleted) when it is not intact."""
        path = self._path(op.key)
        header = read_header(path)
        ok = False
        if (header is not None and header["fingerprint"] == self.fingerprint and header["group"] == op.group
                and header["nbytes"] == out.numel()):
            view = memoryview(out.numpy())
            try:
                with open(path, "rb") as f:
                    f.seek(header["offset"])
                    ok = f.readinto(view) == out.numel()
            except OSError:
                ok = False
            ok = ok and hashlib.sha256(view).hexdigest() == header["sha256"]
        if not ok:
            logger.warning("KV disk tier: entry %s is corrupt or incomplete; it is not used", path.name)
            path.unlink(missing_ok=True)
            return None
        return out
