"""Tensor-parallel layers: linears, embedding and LM head sharded over the tensor-parallel group.

What belongs here: the few sharded modules a model swaps in for ``nn.Linear`` / ``nn.Embedding``
(gpt-fast's ``tp.py`` shape, Megatron's names), the collectives they run, and how a checkpoint
tensor is cut to this rank's shard. What does not: building process groups (``groups.py``,
``executor.py``), expert parallelism (the MoE layers), model math.

Each layer reads the tensor-parallel group from :func:`~deepinfer.parallel.groups.current_groups`
when it is built (or takes one explicitly). At size 1 it is exactly the ``nn.Linear`` /
``nn.Embedding`` it subclasses: same parameters, same names, no communication.

- :class:`ColumnParallelLinear` keeps rows ``[r*N/tp, (r+1)*N/tp)`` of ``weight`` [N, K] (and of
  the bias): each rank computes its slice of the output features. Attention heads and the gate/up
  projections of an MLP shard this way, so the heads a rank computes stay on that rank.
- :class:`RowParallelLinear` keeps columns ``[r*K/tp, (r+1)*K/tp)`` of ``weight``: its input is the
  previous column-parallel output slice, each rank computes a partial product and an all-reduce
  sums them (the bias is added once, after the sum). ``o_proj`` and ``down_proj`` shard this way.
- :class:`VocabParallelEmbedding` keeps rows ``[r*V/tp, (r+1)*V/tp)``; a token outside them looks
  up zeros and the all-reduce adds the one rank's row (exact: x + 0 = x).
- :class:`ParallelLMHead` is a column-parallel ``lm_head`` over the vocabulary whose logits are
  all-gathered, so every rank holds all V logits (the sampler runs on each rank, identically).

Parameters that are shards carry ``tp_shard = (dim, rank, size)``; ``CausalLM.load_weights``
narrows each full checkpoint tensor to this rank's part (:func:`shard_of`) before copying it.

Numerics: the row-parallel sum adds ``tp`` partial dot products instead of one, so results
differ from the single-device ones by rounding (float32: ~1e-7 relative).

Shapes: T tokens, K input features, N output features, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deepinfer.parallel.groups import Group, current_groups


def _tp_group(group: Group | None) -> Group:
    return current_groups().tp if group is None else group


def _local_size(full: int, group: Group, what: str) -> int:
    if full % group.size:
        raise ValueError(f"{what}={full} is not divisible by tensor_parallel_size={group.size}")
    return full // group.size


def check_divides(tp: int, sizes: dict[str, int]) -> None:
    """Raise unless ``tp`` divides every config.json width in ``sizes`` (name -> value): the
    check a model's ``check_parallel`` makes before anything loads."""
    for name, value in sizes.items():
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide config.json {name}={value}")


def mark_shard(param: torch.Tensor, dim: int, group: Group) -> None:
    """Record that ``param`` holds this rank's part of a checkpoint tensor along ``dim``."""
    if not group.is_single:
        param.tp_shard = (dim, group.rank, group.size)


def shard_of(param: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """The part of checkpoint ``tensor`` that ``param`` holds on this rank (``tensor`` itself
    for a parameter that is not a shard, or when the checkpoint already has the shard's shape)."""
    spec = getattr(param, "tp_shard", None)
    if spec is None or tensor.shape == param.shape:
        return tensor
    dim, rank, size = spec
    local = param.shape[dim]
    if tensor.dim() != param.dim() or tensor.shape[dim] != local * size:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} cannot be split into "
                         f"{size} shards of {tuple(param.shape)} along dim {dim}")
    return tensor.narrow(dim, rank * local, local)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum of ``x`` over the ranks of ``group`` (``x`` itself at size 1)."""
    if group.is_single:
        return x
    dist.all_reduce(x, group=group.group)
    return x


def all_gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``x`` [..., n] of every rank, concatenated in rank order along the last dim: [..., n*size]."""
    if group.is_single:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x, group=group.group)
    return torch.cat(parts, dim=-1)


class ColumnParallelLinear(nn.Linear):
    """``nn.Linear(in_features, out_features)`` whose output features are split over the group:
    x [T, K] -> this rank's slice [T, N/tp] (or all of [T, N] with ``gather_output``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 gather_output: bool = False, group: Group | None = None) -> None:
        g = _tp_group(group)
        super().__init__(in_features, _local_size(out_features, g, "out_features"), bias=bias)
        self.tp = g
        self.full_out_features = out_features
        self.gather_output = gather_output
        mark_shard(self.weight, 0, g)
        if self.bias is not None:
            mark_shard(self.bias, 0, g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)                      # [T, N/tp]
        return all_gather_last(out, self.tp) if self.gather_output else out


class RowParallelLinear(nn.Linear):
    """``nn.Linear(in_features, out_features)`` whose input features are split over the group:
    this rank's input slice [T, K/tp] -> the full output [T, N], summed over ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 group: Group | None = None) -> None:
        g = _tp_group(group)
        super().__init__(_local_size(in_features, g, "in_features"), out_features, bias=bias)
        self.tp = g
        self.full_in_features = in_features
        mark_shard(self.weight, 1, g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(F.linear(x, self.weight), self.tp)            # [T, N]
        # After the sum, so the bias counts once.
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding(vocab_size, dim)`` whose rows are split over the group; ids [T] -> [T, dim]."""

    def __init__(self, vocab_size: int, embedding_dim: int, group: Group | None = None) -> None:
        g = _tp_group(group)
        super().__init__(_local_size(vocab_size, g, "vocab_size"), embedding_dim)
        self.tp = g
        self.vocab_size = vocab_size
        self.vocab_start = g.rank * self.num_embeddings
        mark_shard(self.weight, 0, g)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.is_single:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, dim]
        out.masked_fill_(outside[:, None], 0.0)
        return all_reduce(out, self.tp)


class ParallelLMHead(ColumnParallelLinear):
    """The output projection over a vocabulary split like :class:`VocabParallelEmbedding`:
    hidden [N, H] -> logits [N, V], gathered so every rank has all of them."""

    def __init__(self, hidden_size: int, vocab_size: int, group: Group | None = None) -> None:
        super().__init__(hidden_size, vocab_size, bias=False, gather_output=True, group=group)
