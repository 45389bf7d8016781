"""Paged KV-cache bookkeeping: block pool, per-group managers, prefix cache.

CPU-side only: this module hands out block ids and never touches a tensor.
The runner lays device memory out to match (runner/model_runner.py).

Memory is one pool of equal-sized *pages*. A page holds ``block_size`` entries
for every layer of one KV-cache group, so a block id means the same page in all
of that group's layers. Groups whose layers need fewer bytes per entry get
proportionally larger blocks (powers of two), so pages stay nearly full.

Groups behave differently:

- ``full``: one entry per token, blocks are kept for the sequence's lifetime.
- ``sliding``: one entry per token, but only the last ``window`` tokens are
  ever read again; blocks wholly before that go back to the pool (still
  prefix-cached until evicted), so a sequence holds at most
  ``ceil(window / block_size) + 1`` blocks.
- ``compressed``: one entry per ``ratio`` tokens (written once a window of
  ``ratio`` tokens is complete), kept for the sequence's lifetime.

Prefix caching hashes *full* blocks: a block's key is a SHA-256 chained over
the previous block's key, the group and the token ids it covers. A block is
reusable by any sequence whose prefix has the same key. Unreferenced cached
blocks stay in the free queue in LRU order and are evicted only when the pool
needs a fresh block. Block 0 is the null block: never allocated, it fills
block-table slots a sequence does not hold.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from deepinfer.kv_spec import KVCacheSpec

NULL_BLOCK = 0


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per sequence."""

    kind: str
    layer_ids: tuple[int, ...]
    specs: tuple[KVCacheSpec, ...]
    block_size: int                 # entries per block
    sliding_window: int | None = None
    compress_ratio: int = 1

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.compress_ratio

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * sum(s.entry_bytes for s in self.specs)


# A group's block may hold at most this many times ``block_size`` entries. Larger
# blocks fill pages better but coarsen prefix caching: a hit is a whole number of
# every group's blocks.
MAX_BLOCK_SCALE = 4


def build_groups(specs: Sequence[KVCacheSpec], block_size: int) -> list[KVCacheGroup]:
    """Group layers by spec kind and pick each group's block size so that every
    group's block fits one page (the largest group's ``block_size`` block), filling
    it as far as ``MAX_BLOCK_SCALE`` allows."""
    by_key: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        by_key.setdefault(spec.group_key, []).append(i)
    per_entry = {key: sum(specs[i].entry_bytes for i in ids) for key, ids in by_key.items()}
    page = block_size * max(per_entry.values())
    groups = []
    for key, ids in by_key.items():
        scale = 1
        while scale < MAX_BLOCK_SCALE and block_size * scale * 2 * per_entry[key] <= page:
            scale *= 2
        kind, window, ratio = key
        groups.append(KVCacheGroup(kind=kind, layer_ids=tuple(ids),
                                   specs=tuple(specs[i] for i in ids),
                                   block_size=block_size * scale,
                                   sliding_window=window, compress_ratio=ratio))
    return groups


# Pages are a whole number of this many bytes: a page buffer holds layers of several dtypes
# (packed uint8 records beside float states), each viewed in its own dtype, which needs every
# page (and every layer's part, runner/model_runner.py) aligned to its element size.
PAGE_ALIGN = 16


def page_bytes(groups: Sequence[KVCacheGroup]) -> int:
    page = max(g.bytes_per_block for g in groups)
    return -(-page // PAGE_ALIGN) * PAGE_ALIGN


def kv_bytes_per_token(groups: Sequence[KVCacheGroup]) -> tuple[float, int]:
    """What the cache costs: (bytes per token of context in the groups that keep every entry:
    a full group's entry a token, a compressed group's one per ``ratio`` tokens; bytes one
    sequence holds at most in the sliding groups, ``window`` entries each). Entry bytes are the
    specs' own: packed records count their record bytes."""
    per_token, per_sequence = 0.0, 0
    for g in groups:
        entry = sum(s.entry_bytes for s in g.specs)
        if g.kind == "sliding":
            per_sequence += g.sliding_window * entry
        else:
            per_token += entry / g.compress_ratio
    return per_token, per_sequence


def hash_block(parent: bytes | None, group_id: int, token_bytes: bytes) -> bytes:
    """The chained hash of one full block: its parent's hash, the group and the block's
    token ids as little-endian uint32 (:func:`token_bytes`)."""
    h = hashlib.sha256(parent or b"root")
    h.update(group_id.to_bytes(4, "little"))
    h.update(token_bytes)
    return h.digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, the form block hashes take (one numpy conversion
    for a whole prompt, not a Python call per token)."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


class BlockPool:
    """Reference-counted blocks with an LRU free queue and a hash -> block map.

    Mutated only by the managers below. A block is *free* when its reference
    count is 0; a free block may still be cached (its hash is registered), and
    stays reusable by a prefix hit until :meth:`allocate` evicts it.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache has {num_blocks} blocks; at least 2 are needed")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Free blocks, least recently used first. Block 0 is never free.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            key = self.block_hash[block]
            if key is not None:
                del self.cached[key]
                self.block_hash[block] = None
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def lookup(self, key: bytes) -> int | None:
        return self.cached.get(key) if self.enable_caching else None

    def acquire(self, block: int) -> None:
        """Take another reference to a block (a prefix hit or a fork)."""
        if block == NULL_BLOCK:
            return
        if self.ref_cnt[block] == 0:
            del self.free[block]
        self.ref_cnt[block] += 1

    def release(self, block: int) -> None:
        if block == NULL_BLOCK:
            return
        self.ref_cnt[block] -= 1
        assert self.ref_cnt[block] >= 0, f"block {block} released twice"
        if self.ref_cnt[block] == 0:
            self.free[block] = None

    def register(self, block: int, key: bytes) -> None:
        if not self.enable_caching or self.block_hash[block] is not None:
            return
        if key in self.cached:
            return
        self.block_hash[block] = key
        self.cached[key] = block

    def reset_prefix_cache(self) -> None:
        for key, block in list(self.cached.items()):
            self.block_hash[block] = None
        self.cached.clear()


class GroupManager:
    """Block tables of one KV-cache group. ``tables[req_id][i]`` is the block
    holding entries ``i*block_size .. (i+1)*block_size - 1`` of that sequence."""

    def __init__(self, group_id: int, group: KVCacheGroup, pool: BlockPool) -> None:
        self.group_id = group_id
        self.group = group
        self.pool = pool
        self.tables: dict[str, list[int]] = {}
        # Number of leading blocks of each sequence already registered in the prefix cache.
        self.num_cached: dict[str, int] = {}
        # Sliding groups: blocks before this index of each table are already freed (NULL), so
        # a step scans only the blocks that just left the window, not the whole dead prefix.
        self.freed_upto: dict[str, int] = {}

    # -- sizes -------------------------------------------------------------
    def entries_for(self, num_tokens: int) -> int:
        if self.group.kind == "compressed":
            return num_tokens // self.group.compress_ratio
        return num_tokens

    def blocks_for(self, num_tokens: int) -> int:
        return -(-self.entries_for(num_tokens) // self.group.block_size)

    def first_live_token(self, num_computed: int) -> int:
        """Earliest token the next query (at position ``num_computed``) can read."""
        if self.group.kind == "sliding":
            return max(0, num_computed - self.group.sliding_window + 1)
        return 0

    def max_blocks_held(self, num_tokens: int) -> int:
        """Most blocks a sequence of ``num_tokens`` tokens holds at once."""
        n = self.blocks_for(num_tokens)
        if self.group.kind == "sliding":
            return min(n, -(-self.group.sliding_window // self.group.block_size) + 1)
        return n

    def num_new_blocks(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        table = self.tables.get(req_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need <= 0:                      # most decode steps: the last block has room
            return 0
        # Sliding blocks that leave the window before this step are freed first.
        dead = self.first_live_token(num_computed) // self.group.tokens_per_block
        reusable = sum(1 for b in table[self.freed_upto.get(req_id, 0):dead]
                       if b != NULL_BLOCK and self.pool.ref_cnt[b] == 1)
        return max(0, need - reusable)

    # -- mutation ----------------------------------------------------------
    def free_out_of_window(self, req_id: str, num_computed: int) -> None:
        if self.group.kind != "sliding":
            return
        table = self.tables.get(req_id)
        if not table:
            return
        dead = min(self.first_live_token(num_computed) // self.group.tokens_per_block, len(table))
        start = self.freed_upto.get(req_id, 0)
        for i in range(start, dead):
            if table[i] != NULL_BLOCK:
                self.pool.release(table[i])
                table[i] = NULL_BLOCK
        self.freed_upto[req_id] = max(start, dead)

    def allocate(self, req_id: str, num_tokens: int) -> None:
        table = self.tables.setdefault(req_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))

    def cache_full_blocks(self, req_id: str, hashes: Sequence[bytes], num_tokens: int) -> None:
        """Register blocks fully written after ``num_tokens`` computed tokens."""
        table = self.tables.get(req_id, [])
        done = self.num_cached.get(req_id, 0)
        full = min(num_tokens // self.group.tokens_per_block, len(hashes), len(table))
        for i in range(done, full):
            if table[i] != NULL_BLOCK:
                self.pool.register(table[i], hashes[i])
        self.num_cached[req_id] = max(done, full)

    def free(self, req_id: str) -> None:
        # Tail blocks first, so the LRU queue evicts a sequence's last blocks before its prefix.
        for block in reversed(self.tables.pop(req_id, [])):
            self.pool.release(block)
        self.num_cached.pop(req_id, None)
        self.freed_upto.pop(req_id, None)

    def truncate(self, req_id: str, num_tokens: int) -> None:
        table = self.tables.get(req_id, [])
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self.pool.release(table.pop())
        if req_id in self.freed_upto:
            self.freed_upto[req_id] = min(self.freed_upto[req_id], len(table))
        self.num_cached[req_id] = min(self.num_cached.get(req_id, 0),
                                      num_tokens // self.group.tokens_per_block)

    # -- prefix cache ------------------------------------------------------
    def find_hit(self, hashes: Sequence[bytes], max_tokens: int) -> int:
        """Longest cached prefix (in tokens, block aligned, <= max_tokens) this group can serve."""
        tpb = self.group.tokens_per_block
        n = min(max_tokens // tpb, len(hashes))
        if self.group.kind == "sliding":
            # Only blocks the next query can still read must be present.
            while n > 0:
                first = self.first_live_token(n * tpb) // tpb
                if all(self.pool.lookup(hashes[i]) is not None for i in range(first, n)):
                    return n * tpb
                n -= 1
            return 0
        for i in range(n):
            if self.pool.lookup(hashes[i]) is None:
                return i * tpb
        return n * tpb

    def take_hit(self, req_id: str, hashes: Sequence[bytes], num_tokens: int) -> None:
        """Adopt cached blocks for the first ``num_tokens`` tokens (as found by find_hit)."""
        tpb = self.group.tokens_per_block
        n = num_tokens // tpb
        first = self.first_live_token(num_tokens) // tpb
        table = [NULL_BLOCK] * first
        for i in range(first, n):
            block = self.pool.lookup(hashes[i])
            assert block is not None
            self.pool.acquire(block)
            table.append(block)
        self.tables[req_id] = table
        self.num_cached[req_id] = n
        self.freed_upto[req_id] = first

    def fork(self, src: str, dst: str, num_tokens: int) -> tuple[int, int] | None:
        """Share ``src``'s blocks with ``dst``; the partially filled last block is
        copied. Returns the (src, dst) block pair to copy, if any."""
        table = list(self.tables.get(src, []))
        copy = None
        partial = self.entries_for(num_tokens) % self.group.block_size
        if partial and table and table[-1] != NULL_BLOCK:
            new = self.pool.allocate(1)[0]
            copy = (table[-1], new)
            table[-1] = new
            shared = table[:-1]
        else:
            shared = table
        for block in shared:
            self.pool.acquire(block)
        self.tables[dst] = table
        self.num_cached[dst] = self.num_cached.get(src, 0)
        self.freed_upto[dst] = self.freed_upto.get(src, 0)
        return copy


class KVCacheManager:
    """Coordinates the group managers for the scheduler.

    Contract: every call that succeeds leaves each running sequence with blocks
    for all tokens it has been granted; :meth:`free` returns every block a
    sequence holds (finished, aborted or preempted) to the pool.
    """

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: int,
                 enable_prefix_caching: bool) -> None:
        self.groups = list(groups)
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.managers = [GroupManager(i, g, self.pool) for i, g in enumerate(self.groups)]
        self.enable_prefix_caching = enable_prefix_caching
        # Per-sequence chained block hashes, one list per group; extended as tokens arrive.
        self._hashes: dict[str, list[list[bytes]]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    def max_blocks_for(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens needs at its peak."""
        return sum(m.max_blocks_held(num_tokens) for m in self.managers)

    def block_hashes(self, req_id: str, token_ids: Sequence[int], limit: int | None = None) -> list[list[bytes]]:
        """Per group, the chained hashes of the full blocks among the first ``limit`` (default:
        all) of ``token_ids``, computed once per request and extended as it grows."""
        n = len(token_ids) if limit is None else min(limit, len(token_ids))
        per_group = self._hashes.setdefault(req_id, [[] for _ in self.managers])
        raw: bytes | None = None
        done = min((len(h) * m.group.tokens_per_block for h, m in zip(per_group, self.managers)), default=0)
        for gid, m in enumerate(self.managers):
            hashes = per_group[gid]
            tpb = m.group.tokens_per_block
            while (len(hashes) + 1) * tpb <= n:
                if raw is None:      # the tokens no group has hashed yet, converted once
                    raw = token_bytes(token_ids[done:n])
                i = len(hashes)
                parent = hashes[-1] if hashes else None
                lo = (i * tpb - done) * 4
                hashes.append(hash_block(parent, gid, raw[lo:lo + tpb * 4]))
        return per_group

    def find_prefix_hit(self, req_id: str, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """Tokens of ``token_ids`` already in the cache, whole blocks of every group, at most
        ``max_tokens`` when given. At least one token is always left to compute, so the
        request gets logits to sample from."""
        if not self.enable_prefix_caching:
            return 0
        hashes = self.block_hashes(req_id, token_ids)
        limit = len(token_ids) - 1 if max_tokens is None else min(len(token_ids) - 1, max_tokens)
        while True:
            new = limit
            for gid, m in enumerate(self.managers):
                new = min(new, m.find_hit(hashes[gid], new))
            if new == limit:
                break
            limit = new
        self.prefix_queries += len(token_ids)
        self.prefix_hits += limit
        return limit

    def take_prefix_hit(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        hashes = self.block_hashes(req_id, token_ids)
        for gid, m in enumerate(self.managers):
            m.take_hit(req_id, hashes[gid], num_tokens)

    def num_blocks_needed(self, req_id: str, num_computed: int, num_tokens: int) -> int:
        return sum(m.num_new_blocks(req_id, num_computed, num_tokens) for m in self.managers)

    def allocate(self, req_id: str, num_computed: int, num_tokens: int) -> bool:
        """Hold blocks for ``num_tokens`` tokens; ``num_computed`` are already in the
        cache. Returns False (and changes nothing) if the pool cannot serve it."""
        if self.num_blocks_needed(req_id, num_computed, num_tokens) > self.pool.num_free:
            return False
        for m in self.managers:
            m.free_out_of_window(req_id, num_computed)
            m.allocate(req_id, num_tokens)
        return True

    def completes_block(self, req_id: str, num_computed: int) -> bool:
        """Whether ``num_computed`` cached tokens fill a block some group has not registered
        in the prefix cache yet. Most decode steps fill none: then there is nothing to hash
        (callers skip even building the token list)."""
        return self.enable_prefix_caching and any(
            (m.num_cached.get(req_id, 0) + 1) * m.group.tokens_per_block <= num_computed for m in self.managers)

    def cache_blocks(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register blocks completed by the ``num_computed`` tokens now in the cache."""
        if not self.completes_block(req_id, num_computed):
            return
        hashes = self.block_hashes(req_id, token_ids, num_computed)
        for gid, m in enumerate(self.managers):
            m.cache_full_blocks(req_id, hashes[gid], num_computed)

    def free(self, req_id: str) -> None:
        for m in self.managers:
            m.free(req_id)
        self._hashes.pop(req_id, None)

    def truncate(self, req_id: str, num_tokens: int) -> None:
        """Drop cache entries past ``num_tokens`` (rejected speculative tokens)."""
        for m in self.managers:
            m.truncate(req_id, num_tokens)
        per_group = self._hashes.get(req_id)
        if per_group:
            for gid, m in enumerate(self.managers):
                del per_group[gid][num_tokens // m.group.tokens_per_block:]

    def fork(self, src: str, dst: str, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give ``dst`` a copy-on-write view of ``src``'s first ``num_tokens`` tokens.
        Returns the block copies the runner must make, or None if the pool is full."""
        partial_blocks = sum(1 for m in self.managers if m.entries_for(num_tokens) % m.group.block_size)
        if partial_blocks > self.pool.num_free:
            return None
        copies = []
        for m in self.managers:
            pair = m.fork(src, dst, num_tokens)
            if pair is not None:
                copies.append(pair)
        return copies

    def block_tables(self, req_id: str) -> list[list[int]]:
        return [list(m.tables.get(req_id, [])) for m in self.managers]
