"""Per-step forward metadata, passed explicitly to every layer.

The runner builds one :class:`ForwardContext` per model forward from a
StepPlan. Tokens of all scheduled sequences are flattened into one batch of T
tokens; sequence ``b`` owns rows ``query_start_loc[b]:query_start_loc[b+1]``.
Attention layers find their KV-cache group's block table and slot mapping in
``groups[layer.group_id]``. With ``groups`` empty the forward runs without a
cache (every sequence attends only to its own tokens in this batch): model
tests use that mode to compare against reference implementations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GroupMetadata:
    """Device-side view of one KV-cache group for this step.

    block_table: [B, max_blocks] int32, 0 (the null block) where no block is held
        (padding, or a sliding-window block already returned to the pool).
    slot_mapping: [T] int64, ``block_id * block_size + offset`` where each new
        token's entry goes. Compressed groups leave it to the layer to derive
        entry slots from the block table.
    """

    block_size: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class ForwardContext:
    positions: torch.Tensor            # [T] int64 position of each token in its sequence
    query_start_loc: list[int]         # [B+1] host ints, prefix sums of new tokens per sequence
    seq_lens: list[int]                # [B] host ints, tokens in context after this step
    groups: list[GroupMetadata] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        q = self.query_start_loc
        return [q[i + 1] - q[i] for i in range(len(q) - 1)]

    @classmethod
    def no_cache(cls, seq_lens: list[int], device: torch.device) -> "ForwardContext":
        """Context for a cache-free forward of whole sequences (prefill from position 0)."""
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        positions = torch.cat([torch.arange(n, dtype=torch.long) for n in seq_lens]).to(device)
        return cls(positions=positions, query_start_loc=starts, seq_lens=list(seq_lens))
