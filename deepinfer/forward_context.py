"""Per-step forward metadata, passed explicitly to every layer.

The runner builds one :class:`ForwardContext` per model forward from a
StepPlan. Tokens of all scheduled sequences are flattened into one batch of T
tokens; sequence ``b`` owns rows ``query_start_loc[b]:query_start_loc[b+1]``.
Attention layers find their KV-cache group's block table and slot mapping in
``groups[layer.group_id]``. With ``groups`` empty the forward runs without a
cache (every sequence attends only to its own tokens in this batch): model
tests use that mode to compare against reference implementations.

Host and device copies. ``query_start_loc`` / ``seq_lens`` are host lists for
code that sizes work on the CPU; ``query_start_loc_t`` / ``seq_lens_t`` /
``token_seq`` hold the same facts on the device. A ``decode_only`` context
(every sequence has exactly one new token) may be captured in a CUDA graph and
replayed for other batches of the same size: layers must then read only the
device tensors and derive shapes only from T, B and ``max_seq_len`` (an upper
bound on every ``seq_lens[b]``), never from the host lists, and must not
synchronise with the host (no ``.item()``, ``.tolist()``, ``nonzero``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from deepinfer.layers import side_stream

if TYPE_CHECKING:
    from deepinfer.parallel.context import ContextShard


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
    query_start_loc_t: torch.Tensor | None = None   # [B+1] int32, device copy of query_start_loc
    seq_lens_t: torch.Tensor | None = None          # [B] int32, device copy of seq_lens
    token_seq: torch.Tensor | None = None           # [T] int32, sequence row b of each token
    max_seq_len: int = 0                            # >= every seq_lens[b]; 0: max(seq_lens)
    decode_only: bool = False                       # every sequence has exactly one new token
    # Bounded replay ("YOCO prefill truncation"): [B] host ints, the first position of each
    # sequence that the model's late layers (after its last KV-source layer) compute; they
    # skip the sequence's tokens before it. None: every layer computes every token (bounded
    # replay off, or a ``decode_only`` context, which must not depend on host lists).
    replay_starts: list[int] | None = None
    # [T] int64, or None: window rows at positions below a token's floor are invisible to it
    # (bounded replay: the late layers' windows start empty at the sequence's replay start).
    window_floor: torch.Tensor | None = None
    # Context parallelism (parallel/context.py): this rank's share of a step split over the
    # ``cp`` ranks. The context then describes this rank's tokens only (one row per piece of a
    # sequence), except ``groups[g].slot_mapping``, which stays the whole step's [T_all]:
    # attention layers gather the step's K/V with ``cp.gather`` and store all of it.
    cp: ContextShard | None = None
    # Results that several layers of one forward share (e.g. a KV-cache group's slot tables),
    # keyed by their maker. A context serves one forward: build a new one for the next (or
    # clear this), else the next forward (or a CUDA-graph capture) reuses stale results. An
    # entry a side-stream branch wrote is readable outside it only after the branch's join.
    memo: dict = field(default_factory=side_stream.Memo, repr=False, compare=False)

    def __post_init__(self) -> None:
        device = self.positions.device
        if self.query_start_loc_t is None:
            self.query_start_loc_t = torch.tensor(self.query_start_loc, dtype=torch.int32, device=device)
        if self.seq_lens_t is None:
            self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.int32, device=device)
        if self.token_seq is None:
            self.token_seq = torch.tensor([b for b, n in enumerate(self.query_lens) for _ in range(n)],
                                          dtype=torch.int32, device=device)
        if self.max_seq_len == 0:
            self.max_seq_len = max(self.seq_lens, default=0)

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
