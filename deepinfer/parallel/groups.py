"""The process groups a model is built under: which ranks share its tensor, expert, data and
context parallel work.

What belongs here: the description of one rank's place in each parallel dimension, and the
scope (:func:`use_groups`) that makes it the one model constructors read. What does not:
starting processes or initialising ``torch.distributed`` (the launcher), and how a layer
shards itself (the parallel layers).

Model code stays single-device: a constructor asks :func:`current_groups` how wide its
dimension is and which shard it holds; at size 1 (the default, no ``torch.distributed``
needed) every layer is its plain single-device self.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class Group:
    """One parallel dimension as seen by this rank: ``size`` ranks, this one ``rank`` among them,
    and the ``torch.distributed`` group they communicate over (None when size is 1)."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not in a group of size {self.size}")
        if self.size > 1 and self.group is None:
            raise ValueError(f"a group of size {self.size} needs its torch.distributed process group")

    @property
    def is_single(self) -> bool:
        return self.size == 1


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's tensor (``tp``), expert (``ep``), attention data (``dp``) and context
    (``cp``) parallel groups. All of size 1 by default: one process, one device."""

    tp: Group = field(default_factory=Group)
    ep: Group = field(default_factory=Group)
    dp: Group = field(default_factory=Group)
    cp: Group = field(default_factory=Group)


_SINGLE = ParallelGroups()
_current: list[ParallelGroups] = [_SINGLE]


def current_groups() -> ParallelGroups:
    """The groups models are being built under (all of size 1 outside :func:`use_groups`)."""
    return _current[-1]


@contextlib.contextmanager
def use_groups(groups: ParallelGroups) -> Iterator[ParallelGroups]:
    """Build models under ``groups``: constructors called inside read them through
    :func:`current_groups`."""
    _current.append(groups)
    try:
        yield groups
    finally:
        _current.pop()
