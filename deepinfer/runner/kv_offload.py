"""Byte movement of the KV cache's lower tiers: device pages <-> host memory <-> disk files.

What belongs here: carrying out the scheduler's ``TierOp``s (scheduler/plan.py) on the KV
buffer, the host copies and the disk files; the disk format and its checks; the scan that
finds a disk tier again when an engine starts; transfer counters. What does not: which
blocks live in which tier (scheduler/kv_tiers.py).

An entry is the bytes ``[0, group.bytes_per_block)`` of one page: one group's part of a
block, every layer of the group (runner/model_runner.py lays pages out so). Saves run at
once on the launching thread, before the step's block copies and forward can overwrite the
evicted blocks (on CUDA: a non-blocking copy into pinned memory on the current stream, with
an event the readers wait for). Every other op runs on one worker thread, in order, so disk
writes and reads, and loads, overlap the step's forward; a step's loads are done when
``wait`` returns for it (on CUDA they are copied on a side stream the worker waits for).

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
    """Bytes moved and seconds spent per direction (``DIRECTIONS``), cumulative."""

    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))

    def bandwidth(self, direction: str) -> float:
        """Bytes per second in ``direction`` (0 before anything moved)."""
        s = self.seconds[direction]
        return self.bytes[direction] / s if s > 0 else 0.0


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
    """The lower tiers' bytes for one KV buffer ``[num_blocks, page_bytes]`` (uint8)."""

    def __init__(self, kv_buffer: torch.Tensor, groups: Sequence[KVCacheGroup], fingerprint: str,
                 disk_dir: str | None) -> None:
        self.kv_buffer = kv_buffer
        self.groups = list(groups)
        self.fingerprint = fingerprint
        self.disk_dir = None if disk_dir is None else Path(disk_dir)
        if self.disk_dir is not None:
            self.disk_dir.mkdir(parents=True, exist_ok=True)
        self.cuda = kv_buffer.device.type == "cuda"
        self.host: dict[int, torch.Tensor] = {}               # slot -> bytes
        self._ready: dict[int, torch.cuda.Event] = {}        # CUDA: slot -> its save's event
        self._stream = torch.cuda.Stream(kv_buffer.device) if self.cuda else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-kv-tiers")
        self._pending: list[Future] = []
        self._importing = False
        self._lock = threading.Lock()
        self.stats = TransferStats()

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
        """Carry out a plan's ops: saves now, the rest queued on the worker in order. Returns
        the futures of its loads (each gives the key whose load failed, or None)."""
        loads = []
        for op in ops:
            if op.kind == "save":
                self._save(op)
                continue
            future = self._worker.submit(self._run, op)
            self._pending.append(future)
            if op.kind == "load":
                loads.append(future)
        self._pending = [f for f in self._pending if not f.done()]
        return loads

    def put_host(self, slot: int, data: bytes | torch.Tensor) -> None:
        """Host-tier bytes for ``slot`` that came from another engine (scheduler/kv_tiers.py,
        ``TierIndex.imported``), as bytes or as a uint8 tensor on any device (a mapped
        same-host buffer): stored as a save's copy would be. Copies from a device are queued;
        :meth:`sync_imports` waits for them."""
        if isinstance(data, torch.Tensor):
            host = torch.empty(data.shape, dtype=torch.uint8, pin_memory=self.cuda)
            host.copy_(data, non_blocking=data.is_cuda)
            self._importing |= data.is_cuda
        else:
            host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            host = host.pin_memory() if self.cuda else host
        self.host[slot] = host

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
            self.stats.bytes[direction] += nbytes
            self.stats.seconds[direction] += seconds

    def _page_part(self, group: int, block: int) -> torch.Tensor:
        return self.kv_buffer[block, :self.groups[group].bytes_per_block]

    def _save(self, op: TierOp) -> None:
        t0 = time.perf_counter()
        src = self._page_part(op.group, op.block)
        if self.cuda:
            host = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._ready[op.slot] = event
        else:
            host = src.clone()
        self.host[op.slot] = host
        self._count("device_to_host", host.numel(), time.perf_counter() - t0)

    def _host_copy(self, slot: int) -> torch.Tensor:
        event = self._ready.pop(slot, None)
        if event is not None:
            event.synchronize()
        return self.host[slot]

    def _run(self, op: TierOp) -> bytes | None:
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
            del self.host[op.slot]
        elif op.kind == "drop":
            if op.tier == "host":
                self._ready.pop(op.slot, None)
                del self.host[op.slot]
            else:
                self._path(op.key).unlink(missing_ok=True)
        elif op.kind == "load":
            return self._load(op)
        else:
            raise ValueError(f"unknown KV tier op {op.kind!r}")
        return None

    def _load(self, op: TierOp) -> bytes | None:
        t0 = time.perf_counter()
        if op.tier == "host":
            src, direction = self._host_copy(op.slot), "host_to_device"
        else:
            src, direction = self._read_file(op), "disk_to_device"
            if src is None:
                return op.key
        dst = self._page_part(op.group, op.block)
        if self.cuda:
            with torch.cuda.device(self.kv_buffer.device), torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
            self._stream.synchronize()
        else:
            dst.copy_(src)
        self._count(direction, src.numel(), time.perf_counter() - t0)
        return None

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

    def _read_file(self, op: TierOp) -> torch.Tensor | None:
        """An entry's payload, checked; None (and the file deleted) when it is not intact."""
        path = self._path(op.key)
        header = read_header(path)
        payload = None
        if header is not None and header["fingerprint"] == self.fingerprint and header["group"] == op.group:
            try:
                with open(path, "rb") as f:
                    f.seek(header["offset"])
                    payload = f.read(header["nbytes"])
            except OSError:
                payload = None
            if payload is not None and (len(payload) != self.groups[op.group].bytes_per_block
                                        or hashlib.sha256(payload).hexdigest() != header["sha256"]):
                payload = None
        if payload is None:
            logger.warning("KV disk tier: entry %s is corrupt or incomplete; it is not used", path.name)
            path.unlink(missing_ok=True)
            return None
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return data.pin_memory() if self.cuda else data
