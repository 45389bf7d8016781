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

Prefix caching works at the granularity of the base block size ``G`` (the engine's
``block_size``, the uncompressed groups' block), whatever a group's block spans (a
compressed group's block covers ``block_size x scale x ratio`` tokens: 8,192 on
V4-Flash's ratio-128 group). A key is a SHA-256 chained over the previous *full*
block's key, the group and the token ids from the block's start to a G-token boundary
inside it; the key of a whole block is the one at its last boundary. As a sequence
computes tokens, its open block is registered under the key of every boundary it has
passed, so a block carries several keys. A prefix hit of P tokens (a multiple of G)
shares the whole blocks before P and, where P falls inside a block that holds some of
the prefix's entries, *copies* that block into a fresh one (one page copy on the
device, before the step's forward): the copy's entries below P are the prefix's, and
the new sequence overwrites the rest as it computes. Entries are causal (an entry
depends only on the tokens up to its own), so a block's content below a boundary
never changes once written; rolling back (``truncate``) inside a block drops that
block's keys. Unreferenced cached blocks stay in the free queue in LRU order and are
evicted only when the pool needs a fresh block (with lower tiers, into host memory and disk:
scheduler/kv_tiers.py). Block 0 is the null block: never
allocated, it fills block-table slots a sequence does not hold.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from deepinfer.kv_spec import KVCacheSpec
from deepinfer.scheduler.kv_tiers import TierEntry, TierIndex, TierLoad
from deepinfer.scheduler.plan import TierOp

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
# blocks fill pages better; a prefix hit that ends inside one costs a page copy.
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


def hash_block_prefixes(parent: bytes | None, group_id: int, token_bytes: bytes, step: int) -> list[bytes]:
    """The keys of a block's leading ``step``, ``2 step``, ... tokens (``token_bytes``: the
    block's tokens so far, as in :func:`hash_block`), in one pass. The key at a whole
    block equals :func:`hash_block` of it."""
    h = hashlib.sha256(parent or b"root")
    h.update(group_id.to_bytes(4, "little"))
    keys = []
    for lo in range(0, len(token_bytes) - 4 * step + 1, 4 * step):
        h.update(token_bytes[lo:lo + 4 * step])
        keys.append(h.copy().digest())
    return keys


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, the form block hashes take (one numpy conversion
    for a whole prompt, not a Python call per token)."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


class BlockPool:
    """Reference-counted blocks with an LRU free queue and a key -> block map.

    Mutated only by the managers below. A block is *free* when its reference
    count is 0; a free block may still be cached (keys are registered for it), and
    stays reusable by a prefix hit until :meth:`allocate` evicts it. A block has one
    key per prefix boundary registered for it.

    Eviction: when :meth:`allocate` takes a free block that still has keys, ``on_evict``
    (if set: the lower tiers, scheduler/kv_tiers.py) is told the block, its group and its
    keys first, unless a sliding window dropped it (:meth:`release` with
    ``out_of_window``): such a block only serves a prefix that ends within a window after
    it, which a resumed request never asks for.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache has {num_blocks} blocks; at least 2 are needed")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_keys: list[list[bytes]] = [[] for _ in range(num_blocks)]
        self.cached: dict[bytes, int] = {}
        # Free blocks, least recently used first. Block 0 is never free.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.block_group = [0] * num_blocks
        self.out_of_window: set[int] = set()
        self.on_evict: Callable[[int, int, list[bytes]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / (self.num_blocks - 1)

    def allocate(self, n: int, group: int = 0) -> list[int]:
        """``n`` blocks for group ``group``, least recently used first (evicting their keys)."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            if self.block_keys[block] and self.on_evict is not None and block not in self.out_of_window:
                self.on_evict(block, self.block_group[block], list(self.block_keys[block]))
            self.out_of_window.discard(block)
            self.unregister(block)
            self.ref_cnt[block] = 1
            self.block_group[block] = group
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
            self.out_of_window.discard(block)
        self.ref_cnt[block] += 1

    def release(self, block: int, out_of_window: bool = False) -> None:
        """Drop a reference; ``out_of_window``: a sliding window let the block go (see the
        class docstring: not worth keeping in a lower tier if it is the last reference)."""
        if block == NULL_BLOCK:
            return
        self.ref_cnt[block] -= 1
        assert self.ref_cnt[block] >= 0, f"block {block} released twice"
        if self.ref_cnt[block] == 0:
            self.free[block] = None
            if out_of_window:
                self.out_of_window.add(block)

    def register(self, block: int, key: bytes) -> None:
        """Make ``block`` the cached block of ``key`` (unless another block already is)."""
        if not self.enable_caching or key in self.cached:
            return
        self.block_keys[block].append(key)
        self.cached[key] = block

    def unregister(self, block: int) -> None:
        """Drop every key of ``block`` (its content is about to change)."""
        for key in self.block_keys[block]:
            del self.cached[key]
        self.block_keys[block] = []

    def reset_prefix_cache(self) -> None:
        for block in set(self.cached.values()):
            self.block_keys[block] = []
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

    def open_entries(self, num_tokens: int) -> int:
        """Entries of the first ``num_tokens`` tokens that lie in the block holding token
        ``num_tokens`` (the entries a prefix hit of that length must copy)."""
        return self.entries_for(num_tokens) - num_tokens // self.group.tokens_per_block * self.group.block_size

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
                self.pool.release(table[i], out_of_window=True)
                table[i] = NULL_BLOCK
        self.freed_upto[req_id] = max(start, dead)

    def allocate(self, req_id: str, num_tokens: int) -> None:
        table = self.tables.setdefault(req_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need, self.group_id))

    def cache_full_blocks(self, req_id: str, hashes: Sequence[bytes], num_tokens: int) -> None:
        """Register blocks fully written after ``num_tokens`` computed tokens."""
        table = self.tables.get(req_id, [])
        done = self.num_cached.get(req_id, 0)
        full = min(num_tokens // self.group.tokens_per_block, len(hashes), len(table))
        for i in range(done, full):
            if table[i] != NULL_BLOCK:
                self.pool.register(table[i], hashes[i])
        self.num_cached[req_id] = max(done, full)

    def cache_open_block(self, req_id: str, num_tokens: int, keys: Sequence[bytes]) -> None:
        """Register the block holding token ``num_tokens`` under ``keys``, the keys of its
        prefixes up to ``num_tokens`` (each boundary of the base block size)."""
        table = self.tables.get(req_id, [])
        i = num_tokens // self.group.tokens_per_block
        if i < len(table) and table[i] != NULL_BLOCK and self.open_entries(num_tokens):
            for key in keys:
                self.pool.register(table[i], key)

    def free(self, req_id: str) -> None:
        # Tail blocks first, so the LRU queue evicts a sequence's last blocks before its prefix.
        for block in reversed(self.tables.pop(req_id, [])):
            self.pool.release(block)
        self.num_cached.pop(req_id, None)
        self.freed_upto.pop(req_id, None)

    def truncate(self, req_id: str, num_tokens: int) -> tuple[int, int] | None:
        """Drop the blocks past ``num_tokens``. The block that keeps some entries and loses
        others will be rewritten: its keys go, and if another sequence shares it, it is
        copied first (returned as the (src, dst) pair to copy)."""
        table = self.tables.get(req_id, [])
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self.pool.release(table.pop())
        if req_id in self.freed_upto:
            self.freed_upto[req_id] = min(self.freed_upto[req_id], len(table))
        self.num_cached[req_id] = min(self.num_cached.get(req_id, 0),
                                      num_tokens // self.group.tokens_per_block)
        last = len(table) - 1
        if last < 0 or table[last] == NULL_BLOCK or not self.entries_for(num_tokens) % self.group.block_size:
            return None
        block = table[last]
        if self.pool.ref_cnt[block] == 1:
            self.pool.unregister(block)
            return None
        table[last] = self.pool.allocate(1, self.group_id)[0]
        self.pool.release(block)
        return block, table[last]

    # -- prefix cache ------------------------------------------------------
    def find_hit(self, hashes: Sequence[bytes], prefix_key: Callable[[int, int], bytes],
                 max_tokens: int, step: int, has: Callable[[bytes], bool] | None = None) -> int:
        """Longest prefix (a multiple of ``step`` tokens, <= ``max_tokens``) whose entries this
        group can serve from cached blocks: whole blocks by ``hashes`` (the chain of the
        sequence's whole blocks) and the block the prefix ends in by ``prefix_key(i, r)``
        (the key of block i's first r tokens). Sliding groups need only the blocks the next
        query can still read. ``has(key)``: whether a key's block is at hand (default: in
        the device cache; the lower tiers pass one that also looks there)."""
        if has is None:
            has = self._on_device
        tpb = self.group.tokens_per_block
        p = max_tokens // step * step
        while p > 0:
            n = p // tpb
            first = self.first_live_token(p) // tpb
            missing = next((i for i in range(n - 1, first - 1, -1) if not has(hashes[i])), None)
            if missing is not None:
                # A hit must end in block `missing` or before it.
                p = min(p - step, (missing + 1) * tpb - step)
                continue
            if not self.open_entries(p) or has(prefix_key(n, p - n * tpb)):
                return p
            p -= step
        return 0

    def _on_device(self, key: bytes) -> bool:
        return self.pool.lookup(key) is not None

    def hit_keys(self, hashes: Sequence[bytes], prefix_key: Callable[[int, int], bytes],
                 num_tokens: int) -> list[bytes]:
        """The keys of the blocks a hit of ``num_tokens`` tokens takes in this group: the whole
        blocks the next query can read, then the block the hit ends in if it holds some of
        the hit's entries."""
        tpb = self.group.tokens_per_block
        n = num_tokens // tpb
        keys = [hashes[i] for i in range(self.first_live_token(num_tokens) // tpb, n)]
        if self.open_entries(num_tokens):
            keys.append(prefix_key(n, num_tokens - n * tpb))
        return keys

    def take_hit(self, req_id: str, hashes: Sequence[bytes], prefix_key: Callable[[int, int], bytes],
                 num_tokens: int) -> int | None:
        """Adopt cached blocks for the first ``num_tokens`` tokens (as found by find_hit):
        share the whole blocks. Returns the block the prefix ends in, held, which
        :meth:`add_hit_copy` copies into a fresh one, or None."""
        tpb = self.group.tokens_per_block
        n = num_tokens // tpb
        first = self.first_live_token(num_tokens) // tpb
        table = [NULL_BLOCK] * first
        for i in range(first, n):
            block = self.pool.lookup(hashes[i])
            assert block is not None
            self.pool.acquire(block)
            table.append(block)
        src = None
        if self.open_entries(num_tokens):
            src = self.pool.lookup(prefix_key(n, num_tokens - n * tpb))
            assert src is not None
            # Held until the copy is allocated (add_hit_copy): an allocation evicts the least
            # recently used free block, which may be this one.
            self.pool.acquire(src)
        self.tables[req_id] = table
        self.num_cached[req_id] = n
        self.freed_upto[req_id] = first
        return src

    def hit_takes_free(self, hashes: Sequence[bytes], prefix_key: Callable[[int, int], bytes],
                       num_tokens: int) -> int:
        """Blocks that adopting a hit of ``num_tokens`` (take_hit + add_hit_copy) takes out of
        the free pool: its cached blocks that no sequence holds, and the copy."""
        tpb = self.group.tokens_per_block
        n = num_tokens // tpb
        first = self.first_live_token(num_tokens) // tpb
        blocks = [self.pool.lookup(hashes[i]) for i in range(first, n)]
        taken = 0
        if self.open_entries(num_tokens):
            blocks.append(self.pool.lookup(prefix_key(n, num_tokens - n * tpb)))
            taken += 1
        return taken + sum(1 for b in blocks if b is not None and b != NULL_BLOCK and self.pool.ref_cnt[b] == 0)

    def add_hit_copy(self, req_id: str, src: int) -> tuple[int, int]:
        """The fresh block a hit's last, partly shared block ``src`` (held by take_hit) is
        copied into, appended to the table; ``src`` is let go. Returns (src, dst)."""
        dst = self.pool.allocate(1, self.group_id)[0]
        self.pool.release(src)
        self.tables[req_id].append(dst)
        return src, dst

    def fork(self, src: str, dst: str, num_tokens: int) -> tuple[int, int] | None:
        """Share ``src``'s blocks with ``dst``; the partially filled last block is
        copied. Returns the (src, dst) block pair to copy, if any."""
        table = list(self.tables.get(src, []))
        copy = None
        partial = self.entries_for(num_tokens) % self.group.block_size
        if partial and table and table[-1] != NULL_BLOCK:
            new = self.pool.allocate(1, self.group_id)[0]
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

    With lower tiers (``tiers``, scheduler/kv_tiers.py) evicted cached blocks go to the
    tier index, and a hit that reaches into a lower tier is loaded back first
    (:meth:`plan_tier_load`): its blocks come into fresh device blocks, registered under
    their keys when the load lands (:meth:`land_tier_load`), so the request's next lookup
    finds them on the device like any cached block.
    """

    def __init__(self, groups: Sequence[KVCacheGroup], num_blocks: int,
                 enable_prefix_caching: bool, tiers: TierIndex | None = None) -> None:
        self.groups = list(groups)
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.tiers = tiers
        if tiers is not None:
            if not enable_prefix_caching:
                raise ValueError("KV-cache tiers need prefix caching: they hold prefix-cache blocks")
            self.pool.on_evict = tiers.evicted
        self.managers = [GroupManager(i, g, self.pool) for i, g in enumerate(self.groups)]
        self.enable_prefix_caching = enable_prefix_caching
        # Prefix hits are multiples of the base block size (the smallest group's block: groups
        # with more bytes a token have blocks of block_size entries, the rest multiples of it).
        self.hit_step = min(g.block_size for g in self.groups)
        # Per-sequence chained block hashes, one list per group; extended as tokens arrive.
        self._hashes: dict[str, list[list[bytes]]] = {}
        # Per sequence and group: (index, hasher, keys) of the block being filled, its keys
        # so far, extended as the sequence computes (registration is linear in its tokens).
        self._open: dict[str, dict[int, tuple[int, "hashlib._Hash", list[bytes]]]] = {}
        # Per sequence: tokens up to which its blocks are registered (a multiple of hit_step).
        self._keyed_upto: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        # Of prefix_hits, the tokens loaded back from each lower tier.
        self.tier_hits = {"host": 0, "disk": 0}

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

    def _prefix_key_fn(self, gid: int, hashes: Sequence[bytes], token_ids: Sequence[int]
                       ) -> Callable[[int, int], bytes]:
        """``key(i, r)``: the key of block i's first r tokens of ``token_ids`` in group gid
        (each block's keys computed once, on first use)."""
        tpb, step = self.managers[gid].group.tokens_per_block, self.hit_step
        memo: dict[int, list[bytes]] = {}

        def key(i: int, r: int) -> bytes:
            if i not in memo:
                raw = token_bytes(token_ids[i * tpb:min(len(token_ids), (i + 1) * tpb)])
                memo[i] = hash_block_prefixes(hashes[i - 1] if i else None, gid, raw, step)
            return memo[i][r // step - 1]
        return key

    def _hit_tokens(self, hashes: list[list[bytes]], keys: list[Callable[[int, int], bytes]], limit: int,
                    has: Callable[[bytes], bool] | None = None) -> int:
        """The longest prefix, at most ``limit`` tokens, that every group serves (from the
        device cache, or where ``has`` looks: GroupManager.find_hit)."""
        while True:
            new = limit
            for gid, m in enumerate(self.managers):
                new = min(new, m.find_hit(hashes[gid], keys[gid], new, self.hit_step, has))
            if new == limit:
                return limit
            limit = new

    def find_prefix_hit(self, req_id: str, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """Tokens of ``token_ids`` already in the cache (a multiple of ``hit_step``), at most
        ``max_tokens`` when given. At least one token is always left to compute, so the
        request gets logits to sample from."""
        if not self.enable_prefix_caching:
            return 0
        hashes = self.block_hashes(req_id, token_ids)
        keys = [self._prefix_key_fn(gid, hashes[gid], token_ids) for gid in range(len(self.managers))]
        limit = len(token_ids) - 1 if max_tokens is None else min(len(token_ids) - 1, max_tokens)
        hit = self._hit_tokens(hashes, keys, limit)
        # Adopting a hit takes its unheld cached blocks and a fresh block per group it ends
        # inside (the copy) out of the free pool: shorten it if the pool is short.
        while hit and sum(m.hit_takes_free(hashes[gid], keys[gid], hit)
                          for gid, m in enumerate(self.managers)) > self.pool.num_free:
            hit = self._hit_tokens(hashes, keys, hit - self.hit_step)
        return hit

    def probe_prefix_hit(self, token_ids: Sequence[int]) -> int:
        """:meth:`find_prefix_hit` for a prompt no sequence holds, keeping nothing (a data-parallel
        driver asks every rank's cache before it assigns the request)."""
        probe = "\0probe"
        try:
            return self.find_prefix_hit(probe, token_ids)
        finally:
            self._hashes.pop(probe, None)

    def count_lookup(self, num_tokens: int, hit: int) -> None:
        """Count one admitted request's lookup in the prefix-cache counters (tokens queried and
        hit, vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``). Lookups of a request that
        waits and asks again are counted once, when it is admitted."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += hit

    def plan_tier_load(self, req_id: str, token_ids: Sequence[int], max_tokens: int | None,
                       device_hit: int) -> TierLoad | None:
        """A load from the lower tiers that makes a longer hit than the device's
        ``device_hit`` tokens, or None. Allocates one fresh block per entry to load (held by
        the returned TierLoad) and emits the loads as ops; the blocks the device already
        holds for the hit are kept from eviction meanwhile."""
        if self.tiers is None:
            return None
        hashes = self.block_hashes(req_id, token_ids)
        keys = [self._prefix_key_fn(gid, hashes[gid], token_ids) for gid in range(len(self.managers))]
        limit = len(token_ids) - 1 if max_tokens is None else min(len(token_ids) - 1, max_tokens)

        def has(key: bytes) -> bool:
            return self.pool.lookup(key) is not None or self.tiers.has(key)

        hit = self._hit_tokens(hashes, keys, limit, has)
        while hit > device_hit:
            needed = [(gid, key) for gid, m in enumerate(self.managers)
                      for key in m.hit_keys(hashes[gid], keys[gid], hit)]
            held = [self.pool.lookup(key) for _, key in needed]
            entries: dict[bytes, tuple[int, TierEntry]] = {}     # entry key -> (group, entry)
            for (gid, key), block in zip(needed, held):
                if block is None:
                    entry = self.tiers.lookup(key)
                    entries.setdefault(entry.key, (gid, entry))
            # Loaded blocks, unheld cached blocks of the hit, and a copy per group it ends inside.
            copies = sum(1 for m in self.managers if m.open_entries(hit))
            takes = len(entries) + copies + sum(1 for b in set(held) if b is not None and self.pool.ref_cnt[b] == 0)
            if takes <= self.pool.num_free:
                break
            hit = self._hit_tokens(hashes, keys, hit - self.hit_step, has)
        if hit <= device_hit:
            return None
        on_device = sorted({b for b in held if b is not None})
        for block in on_device:
            self.pool.acquire(block)
        for _, entry in entries.values():
            self.tiers.touch(entry)
        blocks = [(gid, self.pool.allocate(1, gid)[0], entry) for gid, entry in entries.values()]
        for block in on_device:
            self.pool.release(block)
        if any(not (entry.in_host or entry.on_disk) for _, _, entry in blocks):
            # Saving what the allocations evicted pushed an entry out of every tier.
            for _, block, _ in blocks:
                self.pool.release(block)
            return None
        tiers = [self.tiers.loaded(entry) for _, _, entry in blocks]
        for (gid, block, entry), tier in zip(blocks, tiers):
            self.tiers.ops.append(TierOp("load", entry.key, gid, slot=entry.slot, block=block,
                                         tier=tier, req_id=req_id))
        return TierLoad(req_id, blocks, device_hit, hit, "disk" if "disk" in tiers else "host")

    def land_tier_load(self, load: TierLoad, failed: set[bytes], corrupt: bool = True) -> None:
        """A load's step landed: register each loaded block under its entry's keys, except
        those whose load ``failed``, which go back unused; ``corrupt``: they failed because
        their disk entries are corrupt (the index forgets them), not because the step did."""
        kept = []
        for gid, block, entry in load.blocks:
            if entry.key in failed:
                if corrupt:
                    self.tiers.load_failed(entry)
                self.pool.release(block)
                continue
            for key in entry.keys:
                self.pool.register(block, key)
            kept.append((gid, block, entry))
        load.blocks = kept
        load.landed = True

    def release_tier_load(self, load: TierLoad) -> None:
        """Let a landed load's blocks go (what the request's hit adopted stays held by it)."""
        for _, block, _ in load.blocks:
            self.pool.release(block)
        load.blocks = []

    def count_tier_hit(self, load: TierLoad, hit: int) -> None:
        """A request admitted with a hit of ``hit`` tokens after ``load``: the tokens past the
        device's own hit count for the load's tier."""
        self.tier_hits[load.tier] += max(0, hit - load.device_hit)

    def persist(self) -> None:
        """Save every cached device block no sequence holds to the tiers, and the host tier
        to the disk tier (an engine shutting down; the device keeps its blocks)."""
        if self.tiers is None:
            return
        for block in list(self.pool.free):
            keys = self.pool.block_keys[block]
            if keys and block not in self.pool.out_of_window:
                self.tiers.evicted(block, self.pool.block_group[block], list(keys))
        self.tiers.persist_host()

    def prefix_blocks(self, token_ids: Sequence[int]) -> tuple[int, list[tuple[int, int, list[bytes]]]]:
        """What another engine needs for the longest prefix hit of ``token_ids`` this device
        cache serves (prefill/decode disaggregation): the hit's tokens, and per block of it
        (group, device block, every key the block carries, shortest prefix first). Only
        reads; the blocks' content is final below the keys they carry (entries are causal)."""
        if not self.enable_prefix_caching:
            return 0, []
        req_id = "\0export"       # never a sequence's id: its hashes are dropped below
        try:
            hashes = self.block_hashes(req_id, token_ids)
            keys = [self._prefix_key_fn(gid, hashes[gid], token_ids) for gid in range(len(self.managers))]
            hit = self._hit_tokens(hashes, keys, len(token_ids) - 1)
            blocks = []
            for gid, m in enumerate(self.managers):
                for key in m.hit_keys(hashes[gid], keys[gid], hit):
                    block = self.pool.lookup(key)
                    blocks.append((gid, block, list(self.pool.block_keys[block])))
            return hit, blocks
        finally:
            self._hashes.pop(req_id, None)

    def import_block(self, group: int, keys: list[bytes]) -> TierEntry | None:
        """A block another engine computed, under ``keys``: a new host-tier entry (its bytes
        go to the entry's slot), or None when this engine holds the block already (device
        or tiers) or its host tier cannot take it."""
        if self.tiers is None:
            raise ValueError("importing KV blocks needs a host tier (kv_offload_bytes > 0)")
        if not 0 <= group < len(self.managers):
            raise ValueError(f"KV block group {group} is out of range [0, {len(self.managers)})")
        if not keys:
            raise ValueError("a KV block comes with at least one key")
        if self.pool.lookup(keys[-1]) is not None:
            return None
        return self.tiers.imported(group, keys)

    def take_tier_ops(self) -> list[TierOp]:
        return [] if self.tiers is None else self.tiers.take_ops()

    def take_prefix_hit(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> list[tuple[int, int]]:
        """Adopt the cached blocks of a hit found by :meth:`find_prefix_hit`. Returns the page
        copies the runner must make before the request's first forward."""
        hashes = self.block_hashes(req_id, token_ids)
        # Every group's blocks are held before any copy is allocated, so that no group's
        # allocation evicts another's source.
        sources = [m.take_hit(req_id, hashes[gid], self._prefix_key_fn(gid, hashes[gid], token_ids), num_tokens)
                   for gid, m in enumerate(self.managers)]
        copies = [m.add_hit_copy(req_id, src) for m, src in zip(self.managers, sources) if src is not None]
        self._keyed_upto[req_id] = num_tokens
        return copies

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
        """Whether ``num_computed`` cached tokens pass a boundary of the base block size not
        registered in the prefix cache yet. Most decode steps pass none: then there is nothing
        to hash (callers skip even building the token list)."""
        return (self.enable_prefix_caching
                and num_computed // self.hit_step * self.hit_step > self._keyed_upto.get(req_id, 0))

    def cache_blocks(self, req_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Register the blocks the ``num_computed`` tokens now in the cache have filled, and
        each group's open block under the key of every boundary it has passed."""
        if not self.completes_block(req_id, num_computed):
            return
        hashes = self.block_hashes(req_id, token_ids, num_computed)
        step = self.hit_step
        open_blocks = self._open.setdefault(req_id, {})
        for gid, m in enumerate(self.managers):
            m.cache_full_blocks(req_id, hashes[gid], num_computed)
            tpb = m.group.tokens_per_block
            i, rem = divmod(num_computed, tpb)
            if rem < step or not m.open_entries(num_computed):
                continue
            index, hasher, keys = open_blocks.get(gid, (-1, None, []))
            if index != i:
                hasher = hashlib.sha256(hashes[gid][i - 1] if i else b"root")
                hasher.update(gid.to_bytes(4, "little"))
                keys = []
            start = i * tpb + len(keys) * step
            raw = token_bytes(token_ids[start:i * tpb + rem // step * step])
            for lo in range(0, len(raw), 4 * step):
                hasher.update(raw[lo:lo + 4 * step])
                keys.append(hasher.copy().digest())
            open_blocks[gid] = (i, hasher, keys)
            m.cache_open_block(req_id, num_computed, keys)
        self._keyed_upto[req_id] = num_computed // step * step

    def free(self, req_id: str) -> None:
        for m in self.managers:
            m.free(req_id)
        self._hashes.pop(req_id, None)
        self._open.pop(req_id, None)
        self._keyed_upto.pop(req_id, None)

    def truncate(self, req_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Drop cache entries past ``num_tokens`` (rejected speculative tokens). Returns the
        page copies the runner must make first (a block shared with another sequence is
        copied before this one rewrites it)."""
        copies = []
        for m in self.managers:
            pair = m.truncate(req_id, num_tokens)
            if pair is not None:
                copies.append(pair)
        per_group = self._hashes.get(req_id)
        if per_group:
            for gid, m in enumerate(self.managers):
                del per_group[gid][num_tokens // m.group.tokens_per_block:]
        self._open.pop(req_id, None)
        self._keyed_upto[req_id] = min(self._keyed_upto.get(req_id, 0),
                                       num_tokens // self.hit_step * self.hit_step)
        return copies

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
        self._keyed_upto[dst] = self._keyed_upto.get(src, 0)
        return copies

    def block_tables(self, req_id: str) -> list[list[int]]:
        return [list(m.tables.get(req_id, [])) for m in self.managers]
