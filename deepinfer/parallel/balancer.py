"""Runtime expert-parallel load balancing (EPLB while serving): record each MoE layer's expert
load over a window of steps and, every ``interval`` steps, place the experts anew
(``eplb.rebalance_experts``) and move their weights between the ranks.

What belongs here: the load window, the rebalance schedule, the weight moves and the
imbalance figures. What does not: the placement algorithm (parallel/eplb.py), dispatch by a
placement (parallel/expert.py), and reading flags or serving /metrics (the entrypoints read
:attr:`ExpertLoadBalancer.stats`).

Every rank of the EP group calls :meth:`ExpertLoadBalancer.step` once after each engine step,
between forward passes, the same number of times: a rebalance is a sequence of collectives
(an all-reduce of the window's load, then per layer one ``all_to_all_single`` of expert
weights) that all ranks enter together. The placement comes out the same on every rank
because its input is the same all-reduced integer load. Requests are neither dropped nor
paused beyond that step: the move runs synchronously between two forwards, and since the
replicas of an expert hold its exact weights, outputs before and after are the same.

Move of one layer: for each slot of the new placement, a rank takes the expert's weights
from one of its own old slots when it has one, else from a rank that held it (the holders
take turns by destination rank); the two sides derive the same plan from the old and new
maps, so only the weights cross. New weights are assembled in a fresh buffer and copied in
place, so the extra memory is one layer's local experts.

Imbalance of a layer: max / mean of tokens per rank (1.0 is balanced), averaged over layers.
``imbalance_before`` is measured (the pairs each rank's slots received since the last
rebalance); ``imbalance_after`` is the new placement's figure on the same window load, each
expert's load split evenly over its replicas (what replica selection achieves on average).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.layers.moe import FusedMoE
from deepinfer.parallel.eplb import rebalance_experts
from deepinfer.parallel.expert import ExpertParallel


@dataclass(frozen=True)
class EPLBConfig:
    """``window_size`` engine steps of load feed each placement; a rebalance every ``interval``
    steps. ``num_nodes`` and ``num_groups`` choose DeepSeek's policy (eplb.py: hierarchical when
    the expert groups divide over the nodes, else global); the defaults give the global one.
    (The number of redundant slots is a layer property: ``ExpertParallelConfig``.)"""

    window_size: int = 1000
    interval: int = 3000
    num_nodes: int = 1
    num_groups: int = 1

    def __post_init__(self) -> None:
        for name in ("window_size", "interval", "num_nodes", "num_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"EPLB {name}={getattr(self, name)} must be >= 1")


@dataclass(frozen=True)
class EPLBStats:
    """What /metrics reports: rebalances done, steps since the last one (a stalled balancer
    shows as a growing count), and the last rebalance's imbalance before and after (max/mean
    tokens per rank; 0.0 before the first rebalance)."""

    rebalances: int = 0
    steps_since_rebalance: int = 0
    imbalance_before: float = 0.0
    imbalance_after: float = 0.0


class ExpertLoadBalancer:
    """The EPLB state of one model on one rank: its expert-parallel MoE layers, their load
    window and the rebalance schedule."""

    def __init__(self, model: nn.Module, config: EPLBConfig) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.ep is not None]
        if not self.layers:
            raise ValueError("EPLB needs expert-parallel MoE layers: build the model under an expert-"
                             "parallel group (parallel.groups.use_groups) or with redundant experts")
        self.config = config
        # Load counted before balancing began (warm-up, profiling forwards) is not serving load.
        for m in self.layers:
            m.ep.take_load()
        # Per layer: logical load [E] of each of the last window_size steps.
        self._window: list[deque[torch.Tensor]] = [deque(maxlen=config.window_size) for _ in self.layers]
        # Per layer: pairs per physical slot [P] since the last rebalance (measured imbalance).
        self._since = [torch.zeros(m.ep.num_slots, dtype=torch.long) for m in self.layers]
        self._steps = 0
        self.stats = EPLBStats()

    def step(self) -> bool:
        """Record the load of the step just run and rebalance when ``interval`` steps have passed
        since the last rebalance. Returns whether it rebalanced. Every rank calls it after every
        step."""
        for i, layer in enumerate(self.layers):
            ep = layer.ep
            load = ep.take_load().cpu()                                             # [P]
            self._since[i] += load
            self._window[i].append(torch.zeros(ep.num_experts, dtype=torch.long)
                                   .index_add_(0, ep.phy2log.cpu(), load))
        self._steps += 1
        if self._steps < self.config.interval:
            self.stats = EPLBStats(self.stats.rebalances, self._steps, self.stats.imbalance_before,
                                   self.stats.imbalance_after)
            return False
        self.rebalance()
        return True

    @torch.no_grad()
    def rebalance(self) -> None:
        """Place every layer's experts for the window's load and move the weights (all ranks)."""
        before, after = [], []
        for shape in _shapes(self.layers):
            idx = [i for i, m in enumerate(self.layers) if _shape(m.ep) == shape]
            window = torch.stack([sum(self._window[i], torch.zeros(shape[0], dtype=torch.long))
                                  for i in idx])                                    # [L, E]
            since = torch.stack([self._since[i] for i in idx])                      # [L, P]
            group = self.layers[idx[0]].ep.group
            if group.size > 1:
                both = torch.cat([window, since], dim=1)
                dist.all_reduce(both, group=group.group)
                window, since = both.split([shape[0], shape[1]], dim=1)
            phy2log, _, logcnt = rebalance_experts(window, shape[1], self.config.num_groups,
                                                   self.config.num_nodes, group.size)
            for row, i in enumerate(idx):
                before.append(_imbalance(since[row].float(), group.size))
                per_slot = (window[row].float() / logcnt[row])[phy2log[row]]        # [P]
                after.append(_imbalance(per_slot, group.size))
                move_experts(self.layers[i], phy2log[row])
        for since in self._since:
            since.zero_()
        self._steps = 0
        self.stats = EPLBStats(self.stats.rebalances + 1, 0, sum(before) / len(before),
                               sum(after) / len(after))


def _shape(ep: ExpertParallel) -> tuple[int, int]:
    return ep.num_experts, ep.num_slots


def _shapes(layers: list[FusedMoE]) -> list[tuple[int, int]]:
    """The distinct (E, P) of the layers, in first-seen order (a drafter's MoE may differ)."""
    return list(dict.fromkeys(_shape(m.ep) for m in layers))


def _imbalance(slot_load: torch.Tensor, num_ranks: int) -> float:
    """max / mean of the load per rank of ``slot_load`` [P] (1.0 when there is no load)."""
    per_rank = slot_load.view(num_ranks, -1).sum(1)
    mean = per_rank.mean().item()
    return per_rank.max().item() / mean if mean > 0 else 1.0


@torch.no_grad()
def move_experts(layer: FusedMoE, phy2log: torch.Tensor) -> None:
    """Put ``layer``'s expert weights in the placement ``phy2log`` [P] and take it as the layer's
    map. A collective: every rank of the layer's EP group calls it with the same ``phy2log``."""
    ep = layer.ep
    group, s = ep.group, ep.slots_per_rank
    old = ep.phy2log.tolist()
    new = phy2log.tolist()
    holders: dict[int, list[int]] = {}
    for slot, e in enumerate(old):
        if not holders.get(e) or holders[e][-1] != slot // s:
            holders.setdefault(e, []).append(slot // s)

    def source(dest: int, e: int) -> int:
        """The rank that gives expert e to rank ``dest`` (dest itself when it holds e)."""
        if dest in holders[e]:
            return dest
        return holders[e][dest % len(holders[e])]

    me = group.rank
    mine_old = old[me * s:(me + 1) * s]
    params = (layer.gate_up_proj, layer.down_proj)
    flat = torch.cat([p.data.flatten(1) for p in params], dim=1)                     # [S, D]
    # Rows this rank sends, destination by destination, in the destination's slot order.
    send_rows, send_sizes = [], []
    for dest in range(group.size):
        rows = [mine_old.index(e) for e in new[dest * s:(dest + 1) * s]
                if dest != me and source(dest, e) == me]
        send_rows += rows
        send_sizes.append(len(rows))
    mine_new = new[me * s:(me + 1) * s]
    remote = [j for j, e in enumerate(mine_new) if source(me, e) != me]
    recv_sizes = [sum(1 for j in remote if source(me, mine_new[j]) == src) for src in range(group.size)]
    if group.size > 1:
        sent = flat[send_rows]
        got = flat.new_empty(sum(recv_sizes), flat.shape[1])
        dist.all_to_all_single(got, sent, recv_sizes, send_sizes, group=group.group)
    result = torch.empty_like(flat)
    # Received rows come grouped by source rank, each group in slot order.
    by_source = sorted(remote, key=lambda j: source(me, mine_new[j]))
    for row, j in enumerate(by_source):
        result[j] = got[row]
    for j, e in enumerate(mine_new):
        if source(me, e) == me:
            result[j] = flat[mine_old.index(e)]
    offset = 0
    for p in params:
        width = p.data[0].numel()
        p.data.copy_(result[:, offset:offset + width].view_as(p.data))
        offset += width
    ep.set_placement(phy2log)
