"""Context parallelism: one step's prefill tokens split over the ranks of the ``cp`` group,
every rank keeping the full KV cache ("KV gathered").

What belongs here: which rank computes which of a step's tokens (:func:`split_tokens`, the
balanced zigzag split), the forward context of a rank's own tokens (:func:`shard_step`), the
all-gathers that put per-token tensors back in the step's token order
(:meth:`ContextShard.gather`, :meth:`ContextShard.gather_rows`), and which models take it
(:func:`check_context_parallel`). What does not: the attention layers' use of the gathered
K/V (layers/attention.py, layers/mla.py) and when the runner splits a step
(runner/model_runner.py).

The scheme (vLLM's prefill context parallelism with full KV, ATOM's): each rank runs the
embedding, norms, projections, MLP/MoE of its own tokens only; every attention layer
all-gathers the new tokens' K/V (MLA: latent entries) in token order and writes the whole
step's entries into the rank's own cache, then attends for its own queries over it. Every
rank thus holds the whole sequence's KV, and decode steps run unchanged on every rank.

Split rule. A step is split when one of its sequences feeds at least ``2 * cp`` tokens (a
prefill chunk); otherwise (decode steps, short verification steps) every rank runs all of it,
as without context parallelism. In a split step a sequence of ``n >= 2 * cp`` new tokens is
cut into ``2 * cp`` consecutive chunks (sizes differing by at most one, the longer first);
rank r takes chunks r and ``2 * cp - 1 - r``: under causal attention chunk i costs about i,
so each rank's pair costs the same ("zigzag"). A shorter sequence (a decode row beside the
prefill) goes whole to the rank holding the fewest tokens so far (the lowest such rank),
longest first.
Each of a rank's pieces becomes one row of its forward context: a query run that ends at
its piece's last position, with its sequence's block tables, so the attention kernels see an
ordinary batch whose keys are all in the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from deepinfer.config import EngineConfig
from deepinfer.forward_context import ForwardContext, GroupMetadata
from deepinfer.parallel.groups import Group
from deepinfer.transfer import to_device

_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` of the step's flattened batch, all of sequence row ``seq``."""

    seq: int
    start: int
    end: int


def zigzag_chunks(n: int, cp: int) -> list[tuple[int, int]]:
    """``n`` tokens cut into ``2 * cp`` consecutive ``(start, end)`` chunks whose sizes differ
    by at most one (the longer ones first)."""
    parts = 2 * cp
    base, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return list(zip(bounds[:-1], bounds[1:]))


def split_tokens(query_start_loc: list[int], cp: int) -> list[list[Piece]] | None:
    """Each rank's pieces of a step whose sequence b feeds tokens
    ``query_start_loc[b]:query_start_loc[b+1]`` (module docstring's rule), in token order; None
    when no sequence feeds ``2 * cp`` tokens (every rank runs the whole step)."""
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    lens = [query_start_loc[b + 1] - query_start_loc[b] for b in range(len(query_start_loc) - 1)]
    if cp == 1 or not any(n >= 2 * cp for n in lens):
        return None
    pieces: list[list[Piece]] = [[] for _ in range(cp)]
    load = [0] * cp
    for b, n in enumerate(lens):
        if n >= 2 * cp:
            s = query_start_loc[b]
            chunks = zigzag_chunks(n, cp)
            for r in range(cp):
                # The middle rank's two chunks touch: one piece.
                lo, hi = chunks[r]
                lo2, hi2 = chunks[2 * cp - 1 - r]
                runs = [(lo, hi2)] if hi == lo2 else [(lo, hi), (lo2, hi2)]
                pieces[r].extend(Piece(b, s + a, s + e) for a, e in runs)
                load[r] += hi - lo + hi2 - lo2
    # The short sequences after the split ones, longest first, each to the least loaded rank.
    for n, b in sorted(((n, b) for b, n in enumerate(lens) if 0 < n < 2 * cp), key=lambda nb: (-nb[0], nb[1])):
        r = load.index(min(load))
        pieces[r].append(Piece(b, query_start_loc[b], query_start_loc[b] + n))
        load[r] += n
    return [sorted(p, key=lambda piece: piece.start) for p in pieces]


def token_layout(pieces: list[list[Piece]], num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """``owner[t]`` and ``local[t]`` [num_tokens]: the rank computing token t of the step and
    its row among that rank's tokens; raises unless the pieces cover every token once."""
    owner = np.full(num_tokens, -1, dtype=np.int64)
    local = np.empty(num_tokens, dtype=np.int64)
    for r, mine in enumerate(pieces):
        at = 0
        for p in mine:
            if not 0 <= p.start <= p.end <= num_tokens or (owner[p.start:p.end] >= 0).any():
                raise ValueError(f"piece {p} overlaps another or lies outside the step's {num_tokens} tokens")
            owner[p.start:p.end] = r
            local[p.start:p.end] = np.arange(at, at + p.end - p.start)
            at += p.end - p.start
    if (owner < 0).any():
        raise ValueError(f"the pieces leave token {int(np.flatnonzero(owner < 0)[0])} of {num_tokens} to no rank")
    return owner, local


class ContextShard:
    """One rank's share of a split step: its token rows and the all-gathers that restore the
    step's token order. Attention layers find it in ``ForwardContext.cp``."""

    def __init__(self, group: Group, pieces: list[list[Piece]], step: ForwardContext,
                 device: torch.device) -> None:
        num_tokens = int(step.positions.shape[0])
        self.group = group
        # The whole step's context (every rank's tokens): what a layer that writes the step's
        # cache entries (DeepSeek-V4/V4.1's compressors) pools them by.
        self.step = step
        self.pieces = pieces[group.rank]
        self.owner, self.local = token_layout(pieces, num_tokens)
        self.width = int(np.bincount(self.owner, minlength=group.size).max())
        self.rows = to_device(np.concatenate([np.arange(p.start, p.end) for p in self.pieces]), torch.long, device)
        # Row t of the step in the gathered [size * width] buffer of every rank's padded rows.
        self.order = to_device(self.owner * self.width + self.local, torch.long, device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``x`` [n_local, ...] -> the step's rows [T, ...] in token order."""
        return _all_gather_padded(x, self.width, self.group).index_select(0, self.order)

    def gather_rows(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """This rank's rows ``x`` [n_local, ...] -> the step's ``rows`` (token indices) [N, ...]:
        each rank sends only the rows asked for that it computed."""
        if not rows:
            return x[:0]
        idx = np.asarray(rows, dtype=np.int64)
        owner, local = self.owner[idx], self.local[idx]
        counts = np.bincount(owner, minlength=self.group.size)
        width = int(counts.max())
        # The j-th asked row of its owner sits at row j of that owner's padded block.
        by_owner = np.argsort(owner, kind="stable")
        within = np.empty(len(idx), dtype=np.int64)
        within[by_owner] = np.arange(len(idx)) - np.repeat(np.cumsum(counts) - counts, counts)
        mine = to_device(local[owner == self.group.rank], torch.long, x.device)
        order = to_device(owner * width + within, torch.long, x.device)
        return _all_gather_padded(x.index_select(0, mine), width, self.group).index_select(0, order)


def _all_gather_padded(t: torch.Tensor, width: int, group: Group) -> torch.Tensor:
    """Every rank's ``t`` [n_r, ...] padded to ``width`` rows -> [size * width, ...]."""
    padded = t.new_zeros((width, *t.shape[1:]))
    padded[:t.shape[0]] = t
    out = t.new_empty(group.size * width, *t.shape[1:])
    _all_gather_tensor(out, padded.contiguous(), group=group.group)
    return out


def shard_step(input_ids: torch.Tensor, ctx: ForwardContext, group: Group
               ) -> tuple[torch.Tensor, ForwardContext, ContextShard] | None:
    """This rank's input ids and forward context for a step split over ``group`` (the ``cp``
    group), with the shard that gathers its rows back; None when the step is not split (or
    cannot be: a decode-only context, bounded replay)."""
    if group.is_single or ctx.decode_only or not ctx.groups or ctx.replay_starts is not None:
        return None
    pieces = split_tokens(ctx.query_start_loc, group.size)
    if pieces is None:
        return None
    device = input_ids.device
    shard = ContextShard(group, pieces, ctx, device)
    mine = shard.pieces
    starts = [0]
    seq_lens = []
    for p in mine:
        starts.append(starts[-1] + p.end - p.start)
        # The piece's run ends where its sequence's new tokens end minus what follows it.
        seq_lens.append(ctx.seq_lens[p.seq] - (ctx.query_start_loc[p.seq + 1] - p.end))
    seqs = to_device([p.seq for p in mine], torch.long, device)
    groups = [GroupMetadata(block_size=g.block_size, block_table=g.block_table.index_select(0, seqs),
                            slot_mapping=g.slot_mapping) for g in ctx.groups]
    local = ForwardContext(positions=ctx.positions.index_select(0, shard.rows), query_start_loc=starts,
                           seq_lens=seq_lens, groups=groups,
                           query_start_loc_t=to_device(starts, torch.int32, device),
                           seq_lens_t=to_device(seq_lens, torch.int32, device),
                           token_seq=to_device(np.repeat(np.arange(len(mine), dtype=np.int32), np.diff(starts)),
                                               torch.int32, device),
                           cp=shard)
    return input_ids.index_select(0, shard.rows), local, shard


def check_context_parallel(model_cls: type, config: EngineConfig) -> None:
    """Refuse ``context_parallel_size`` > 1 for a model whose attention layers do not gather
    the K/V of a split step (``CausalLM.supports_context_parallel``), and with bounded replay
    (its late layers compute a sub-context of the step, which is not split)."""
    cp = config.parallel.cp
    if not getattr(model_cls, "supports_context_parallel", False):
        raise NotImplementedError(f"context_parallel_size={cp}: {config.model.architecture} does not support "
                                  "context parallelism yet (supported: Llama, Mistral, Qwen3, Qwen3-MoE, "
                                  "DeepSeek-V3, DeepSeek-V4, DeepSeek-V4.1); run it with context_parallel_size=1")
    mode = config.scheduler.prefill_truncation_mode
    if mode != "full":
        raise NotImplementedError(f"context_parallel_size={cp} with prefill_truncation_mode={mode!r}: bounded "
                                  "replay is not yet supported under context parallelism; use 'full'")
