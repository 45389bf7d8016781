"""Lower tiers of the prefix cache: which evicted blocks live in host memory and on disk.

CPU-side only, like kv_cache.py: this module keeps the index (key -> entry), the LRU order
and the byte budgets of the tiers, and emits the movements (``TierOp``) the runner carries
out (runner/kv_offload.py). It never touches a tensor or a file.

An *entry* is one evicted block of one group: the bytes of that group's part of a page, and
every key the block was registered under (its whole-block key and the keys of its prefixes
at each base-block boundary; kv_cache.py). Its id is its longest key. A device block leaves
the pool's LRU free queue only when an allocation evicts it; then (``evicted``) it is saved
to host memory. When host memory is over budget its least recently used entries move to
disk (or are dropped without a disk tier); when the disk is over budget its least recently
used entries are dropped. A lookup that finds an entry makes it the most recently used of
its tiers. Entries stay in their tier when loaded back (a restarted engine finds the disk's),
and an entry already held is not saved again.

Ordering: ops are executed in the order emitted, plans in the order made. Host copies are
named by a fresh ``slot`` per save, so a drop of an old copy never removes a newer one of
the same key, whatever runs first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from deepinfer.scheduler.plan import TierOp

TIERS = ("host", "disk")


@dataclass
class TierEntry:
    key: bytes                       # the entry's id: its block's longest key
    group: int
    keys: tuple[bytes, ...]          # every key the entry serves
    nbytes: int
    slot: int = -1                   # its host copy, -1: none
    on_disk: bool = False

    @property
    def in_host(self) -> bool:
        return self.slot >= 0


@dataclass
class TierLoad:
    """A prefix hit being loaded back for ``req_id``: one fresh device block per entry, held
    until the request adopts its hit (or ends). ``device_hit``: the tokens the device cache
    served when it was planned; ``hit``: the tokens it serves once loaded; ``tier``: the
    lowest tier it reads (its extra tokens count there)."""

    req_id: str
    blocks: list[tuple[int, int, TierEntry]]     # (group, device block, entry)
    device_hit: int
    hit: int
    tier: str
    landed: bool = False


@dataclass
class TierStats:
    saved_blocks: int = 0
    imported_blocks: int = 0
    loaded_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    failed_loads: int = 0


class TierIndex:
    """The host and disk tiers' index (see the module docstring). ``group_bytes[g]``: the
    bytes of group g's part of a page (an entry's size); ``disk_entries``: entries a disk
    scan found (a restarted engine), oldest first."""

    def __init__(self, host_bytes: int, disk_bytes: int, group_bytes: Sequence[int],
                 disk_entries: Iterable[TierEntry] = ()) -> None:
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError(f"tier budgets must be >= 0 (host {host_bytes}, disk {disk_bytes})")
        self.host_capacity = host_bytes
        self.disk_capacity = disk_bytes
        self.group_bytes = list(group_bytes)
        self.host: OrderedDict[bytes, TierEntry] = OrderedDict()     # least recently used first
        self.disk: OrderedDict[bytes, TierEntry] = OrderedDict()
        self.by_key: dict[bytes, TierEntry] = {}
        self.host_used = self.disk_used = 0
        self.ops: list[TierOp] = []
        self.stats = TierStats()
        self._next_slot = 0
        for entry in disk_entries:
            if entry.group >= len(self.group_bytes) or entry.nbytes != self.group_bytes[entry.group]:
                raise ValueError(f"disk entry {entry.key.hex()} does not fit group {entry.group}'s layout")
            entry.slot, entry.on_disk = -1, True
            self.disk[entry.key] = entry
            self.disk_used += entry.nbytes
            for k in entry.keys:
                self.by_key[k] = entry
        self._fit_disk()

    # -- queries -----------------------------------------------------------------
    def lookup(self, key: bytes) -> TierEntry | None:
        return self.by_key.get(key)

    def has(self, key: bytes) -> bool:
        return key in self.by_key

    def touch(self, entry: TierEntry) -> None:
        """Make ``entry`` the most recently used of its tiers."""
        if entry.in_host:
            self.host.move_to_end(entry.key)
        if entry.on_disk:
            self.disk.move_to_end(entry.key)

    def take_ops(self) -> list[TierOp]:
        ops, self.ops = self.ops, []
        return ops

    # -- movements ---------------------------------------------------------------
    def evicted(self, block: int, group: int, keys: list[bytes]) -> None:
        """The device pool is evicting ``block`` of ``group``, registered under ``keys``
        (shortest prefix first): keep its bytes in host memory."""
        entry = self._hold(group, keys)
        if entry is None:
            return
        self.ops.append(TierOp("save", entry.key, group, slot=entry.slot, block=block, keys=entry.keys))
        self.stats.saved_blocks += 1
        self._fit_host()

    def imported(self, group: int, keys: list[bytes]) -> TierEntry | None:
        """A block of ``group`` under ``keys`` (shortest prefix first) arrives from another
        engine (prefill/decode disaggregation): the new host entry, whose bytes the caller
        puts at its ``slot`` before the next plan's ops run; None when the tiers hold it
        already or host memory cannot take it."""
        if self.group_bytes[group] > self.host_capacity:
            return None
        entry = self._hold(group, keys)
        if entry is not None:
            self.stats.imported_blocks += 1
            self._fit_host()
        return entry

    def _hold(self, group: int, keys: list[bytes]) -> TierEntry | None:
        """A fresh host slot for the block under ``keys``, or None when held already (a disk
        entry that host memory cannot take stays where it is)."""
        key = keys[-1]
        entry = self.by_key.get(key)
        if entry is not None and entry.key == key and (entry.in_host or entry.nbytes > self.host_capacity):
            self.touch(entry)
            return None
        if entry is None or entry.key != key:
            entry = TierEntry(key, group, tuple(keys), self.group_bytes[group])
        entry.slot = self._next_slot
        self._next_slot += 1
        self.host[key] = entry
        self.host_used += entry.nbytes
        for k in entry.keys:
            self.by_key[k] = entry
        return entry

    def loaded(self, entry: TierEntry) -> str:
        """``entry`` is being loaded back: the tier it is read from."""
        tier = "host" if entry.in_host else "disk"
        self.touch(entry)
        self.stats.loaded_blocks[tier] += 1
        return tier

    def load_failed(self, entry: TierEntry) -> None:
        """A load of ``entry`` from disk found it corrupt (the runner deleted the file): forget it."""
        self.stats.failed_loads += 1
        if entry.on_disk:
            entry.on_disk = False
            self.disk_used -= entry.nbytes
            self.disk.pop(entry.key, None)
        if not entry.in_host:
            self._forget(entry)

    def clear_host(self) -> None:
        """Drop every host copy (moving none to disk)."""
        for entry in list(self.host.values()):
            self.ops.append(TierOp("drop", entry.key, entry.group, slot=entry.slot, tier="host"))
            entry.slot = -1
            if not entry.on_disk:
                self._forget(entry)
        self.host.clear()
        self.host_used = 0

    def persist_host(self) -> None:
        """Write every host entry not on disk yet to disk (an engine shutting down), as far as
        the disk budget goes; the host copies stay."""
        if not self.disk_capacity:
            return
        for entry in list(self.host.values()):
            if not entry.on_disk:
                self.ops.append(TierOp("demote", entry.key, entry.group, slot=entry.slot, keys=entry.keys))
                entry.slot = -1
                self.host.pop(entry.key)
                self.host_used -= entry.nbytes
                self._to_disk(entry)
        self._fit_disk()

    def _fit_host(self) -> None:
        while self.host_used > self.host_capacity:
            key, entry = self.host.popitem(last=False)
            self.host_used -= entry.nbytes
            if self.disk_capacity and not entry.on_disk:
                self.ops.append(TierOp("demote", key, entry.group, slot=entry.slot, keys=entry.keys))
                entry.slot = -1
                self._to_disk(entry)
            else:
                self.ops.append(TierOp("drop", key, entry.group, slot=entry.slot, tier="host"))
                entry.slot = -1
                if not entry.on_disk:
                    self._forget(entry)
        self._fit_disk()

    def _to_disk(self, entry: TierEntry) -> None:
        entry.on_disk = True
        self.disk[entry.key] = entry
        self.disk_used += entry.nbytes

    def _fit_disk(self) -> None:
        while self.disk_used > self.disk_capacity:
            key, entry = self.disk.popitem(last=False)
            self.disk_used -= entry.nbytes
            entry.on_disk = False
            self.ops.append(TierOp("drop", key, entry.group, tier="disk"))
            if not entry.in_host:
                self._forget(entry)

    def _forget(self, entry: TierEntry) -> None:
        for k in entry.keys:
            if self.by_key.get(k) is entry:
                del self.by_key[k]
