"""One step's model inputs as host lists, built from the scheduled sequences.

What belongs here: flattening a StepPlan's sequences into token ids, positions,
per-sequence lengths and, per KV-cache group, block tables and the slot each
new token's entry goes to. What does not: device tensors (the runner's eager
path turns these lists into fresh tensors; runner/cuda_graph.py writes them
into the static buffers its graphs read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from deepinfer.scheduler.kv_cache import KVCacheGroup
from deepinfer.scheduler.plan import ScheduledSeq


def token_slot(table: Sequence[int], pos: int, block_size: int, compress_ratio: int) -> int:
    """The flat cache slot (``block * block_size + offset``) the token at ``pos`` writes,
    or -1. A compressed group (ratio r > 1) holds one entry per r tokens, written by
    the token that completes it; every other token writes nothing there."""
    if compress_ratio == 1:
        return table[pos // block_size] * block_size + pos % block_size
    if (pos + 1) % compress_ratio:
        return -1
    e = (pos + 1) // compress_ratio - 1           # this token completes compressed entry e
    return table[e // block_size] * block_size + e % block_size


def seq_slots(table: Sequence[int], start: int, n: int, block_size: int, compress_ratio: int) -> list[int]:
    """:func:`token_slot` of the positions ``start .. start+n-1`` of one sequence; long runs
    (prefill chunks) vectorised with numpy, a Python call per token costing ~1 us."""
    if n == 1:                                               # a decode step
        return [token_slot(table, start, block_size, compress_ratio)]
    if n < 64:
        return [token_slot(table, p, block_size, compress_ratio) for p in range(start, start + n)]
    pos = np.arange(start, start + n, dtype=np.int64)
    rows = np.asarray(table, dtype=np.int64)
    if compress_ratio == 1:
        return (rows[pos // block_size] * block_size + pos % block_size).tolist()
    slots = np.full(n, -1, dtype=np.int64)
    done = np.flatnonzero((pos + 1) % compress_ratio == 0)   # tokens that complete an entry
    e = (pos[done] + 1) // compress_ratio - 1                # (the table may hold no block yet)
    slots[done] = rows[e // block_size] * block_size + e % block_size
    return slots.tolist()


@dataclass
class StepInputs:
    input_ids: list[int]                     # [T]
    positions: list[int]                     # [T]
    query_start_loc: list[int]               # [B+1] prefix sums of new tokens per sequence
    seq_lens: list[int]                      # [B] tokens in context after this step
    block_tables: list[list[list[int]]]      # per group: B rows of unequal length
    slot_mappings: list[list[int]]           # per group: [T], -1 where nothing is written

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def token_seq(self) -> list[int]:
        """[T] the sequence row b of each token."""
        q = self.query_start_loc
        return [b for b in range(self.num_seqs) for _ in range(q[b + 1] - q[b])]

    @property
    def decode_only(self) -> bool:
        """Every sequence feeds exactly one token (the shape a decode CUDA graph serves)."""
        q = self.query_start_loc
        return all(q[i + 1] - q[i] == 1 for i in range(self.num_seqs))

    def per_token(self) -> "StepInputs":
        """The same tokens with each one its own row: a row's length is its position + 1 and
        its block tables are its sequence's. A step whose sequences feed a few tokens each
        (speculative verification: the last token and its drafts) then has the decode shape,
        which the decode graphs serve: each layer stores every row's entries before any row
        reads the cache, so a row sees the rows before it in its sequence as cached tokens."""
        rows = self.token_seq
        return StepInputs(list(self.input_ids), list(self.positions), list(range(len(self.input_ids) + 1)),
                          [p + 1 for p in self.positions], [[tables[b] for b in rows] for tables in self.block_tables],
                          [list(s) for s in self.slot_mappings])

    @classmethod
    def build(cls, seqs: Sequence[ScheduledSeq], groups: Sequence[KVCacheGroup]) -> "StepInputs":
        ids: list[int] = []
        positions: list[int] = []
        starts = [0]
        seq_lens = []
        for seq in seqs:
            n = len(seq.token_ids)
            ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + n))
            starts.append(starts[-1] + n)
            seq_lens.append(seq.start_pos + n)
        tables, slots = [], []
        for gid, group in enumerate(groups):
            rows = [seq.block_tables[gid] for seq in seqs]
            tables.append(rows)
            flat: list[int] = []
            for seq, row in zip(seqs, rows):
                flat += seq_slots(row, seq.start_pos, len(seq.token_ids), group.block_size,
                                  group.compress_ratio)
            slots.append(flat)
        return cls(ids, positions, starts, seq_lens, tables, slots)
