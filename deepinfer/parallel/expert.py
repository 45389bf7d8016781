"""Expert parallelism: a layer's routed experts spread over the ranks of its EP group, tokens
sent to their experts' ranks (dispatch) and the results brought back (combine).

What belongs here: the placement of one layer's experts (which logical expert each physical
slot holds), the choice of a replica for each (token, expert) pair, the two dispatch/combine
paths, and the per-slot load counters EPLB reads. What does not: the expert math (the
``run_experts`` callable a MoE layer passes in, its kernels), routing (done before dispatch,
on each rank's own tokens, so hash-routed layers route by their own token ids), choosing a
new placement (parallel/eplb.py) and moving weights to it (parallel/balancer.py).

Placement. A layer has P = E + R physical slots (R redundant: ``num_redundant_experts``), S =
P / ep of them on each rank; rank r holds slots [r*S, (r+1)*S) and ``phy2log[s]`` is the
logical expert slot s holds. The initial placement is ``phy2log[s] = s mod E``: every expert
once, then the first R experts again, so no rank holds two copies of one expert while S <= E
(checkpoints load only into such placements: layers/moe.py).
A pair (token t, expert e) goes to replica ``t mod replicas(e)`` of e (deterministic, and
spreads a hot expert's tokens over its replicas; replicas hold equal weights, so the choice
never changes an output).

Dispatch and combine. Every rank passes its own tokens (attention data-parallel ranks pass
different ones, replicated attention the same ones; both are correct). Under ``allgather`` and
``auto`` the token counts are all-gathered first (so that all ranks take the same path and
know the gather's width):

- **all-gather** (``allgather``; ``auto`` when no rank has more than ``allgather_max_tokens``
  tokens): every rank gathers all ranks' tokens, routing weights and slots, runs its local
  slots' pairs and writes each pair's weighted output into a zero [T_all, K, H] buffer;
  a reduce-scatter hands each rank its own tokens' pairs. Every pair is non-zero on exactly
  one rank, so the sum adds only zeros to it: exact.
- **all-to-all** (``alltoall``; ``auto`` above the threshold): each rank sends every pair's
  token row, weight and local slot to the slot's rank (``all_to_all_single`` with split
  sizes), the receivers run them and send each pair's output back the same way.

Either way the home rank ends with each pair's weighted expert output [T, K, H] and sums a
token's K outputs in float32 in ascending *logical* expert order, rounded once to the input
dtype. On the CPU in float32 that is the very order and rounding of the single-device
reference (``reference.moe_experts`` adds experts in ascending order), so outputs do not
depend on the EP size beyond the expert GEMMs' own row blocking. Both paths read split sizes
on the host (a sync), so an EP forward is not CUDA-graph capturable.

Shapes: T tokens, H hidden, E logical experts, K experts per token, P physical slots, S slots
per rank, N pairs a rank runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from deepinfer.parallel.groups import Group

DISPATCH_MODES = ("auto", "allgather", "alltoall")

# torch 2.13 renamed the tensor forms (the old names warn); the GPU machines' torch 2.11 has
# only the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# run_experts(x [N, H], weights [N, 1], local slot ids [N, 1]) -> [N, H]: each row one pair's
# weighted expert output (the layer's expert kernel with K = 1).
RunExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertParallelConfig:
    """How expert-parallel MoE layers are built and dispatch.

    ``num_redundant_experts``: extra physical slots per layer (R), holding replicas of busy
    experts once EPLB places them; E + R must divide by the EP size. ``dispatch``: ``auto``,
    ``allgather`` or ``alltoall``; ``auto`` takes the all-gather path while no rank has more
    than ``allgather_max_tokens`` tokens in a forward."""

    num_redundant_experts: int = 0
    dispatch: str = "auto"
    allgather_max_tokens: int = 128

    def __post_init__(self) -> None:
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts={self.num_redundant_experts} must be >= 0")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch={self.dispatch!r} is not a dispatch mode; expected one of "
                             f"{', '.join(DISPATCH_MODES)}")
        if self.allgather_max_tokens < 0:
            raise ValueError(f"allgather_max_tokens={self.allgather_max_tokens} must be >= 0")


_DEFAULT = ExpertParallelConfig()
_current: list[ExpertParallelConfig] = [_DEFAULT]


def current_expert_parallel() -> ExpertParallelConfig:
    """The expert-parallel settings MoE layers are being built under (defaults outside
    :func:`use_expert_parallel`)."""
    return _current[-1]


@contextlib.contextmanager
def use_expert_parallel(config: ExpertParallelConfig) -> Iterator[ExpertParallelConfig]:
    """Build MoE layers under ``config`` (read by their constructors, beside
    ``groups.current_groups()``)."""
    _current.append(config)
    try:
        yield config
    finally:
        _current.pop()


def initial_placement(num_experts: int, num_slots: int) -> torch.Tensor:
    """phy2log [P] of a layer before any load is known: slot s holds expert s mod E."""
    return torch.arange(num_slots) % num_experts


class ExpertParallel(nn.Module):
    """One MoE layer's expert placement, dispatch/combine and load counters.

    Buffers (not in the state dict; they move with the layer): ``phy2log`` [P] the logical
    expert of each slot, ``log2phy`` [E, R + 1] each expert's slots (-1 padded), ``logcnt`` [E]
    its replica count, ``load`` [P] int64 pairs routed to each slot since :meth:`take_load`.
    """

    def __init__(self, num_experts: int, group: Group, config: ExpertParallelConfig) -> None:
        super().__init__()
        num_slots = num_experts + config.num_redundant_experts
        if num_slots % group.size:
            raise ValueError(f"{num_experts} routed experts + num_redundant_experts="
                             f"{config.num_redundant_experts} = {num_slots} slots do not split over an "
                             f"expert-parallel group of {group.size} ranks; choose num_redundant_experts "
                             f"so that the sum divides by {group.size}")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.group = group
        self.config = config
        self.slots_per_rank = num_slots // group.size
        self.register_buffer("phy2log", torch.empty(num_slots, dtype=torch.long), persistent=False)
        self.register_buffer("log2phy", torch.empty(num_experts, num_slots - num_experts + 1,
                                                    dtype=torch.long), persistent=False)
        self.register_buffer("logcnt", torch.empty(num_experts, dtype=torch.long), persistent=False)
        self.register_buffer("load", torch.zeros(num_slots, dtype=torch.long), persistent=False)
        self.set_placement(initial_placement(num_experts, num_slots))

    # -- placement ---------------------------------------------------------------------------
    @property
    def first_slot(self) -> int:
        """This rank's first physical slot (its slots are first_slot .. first_slot + S - 1)."""
        return self.group.rank * self.slots_per_rank

    def local_experts(self) -> list[int]:
        """The logical expert of each of this rank's S slots, in slot order."""
        return self.phy2log[self.first_slot:self.first_slot + self.slots_per_rank].tolist()

    @torch.no_grad()
    def set_placement(self, phy2log: torch.Tensor) -> None:
        """Take ``phy2log`` [P] (e.g. a row of ``eplb.rebalance_experts``' output) as the layer's
        placement. Only the maps change: the caller has put the weights in place."""
        phy2log = phy2log.to(device="cpu", dtype=torch.long)
        if phy2log.shape != (self.num_slots,):
            raise ValueError(f"phy2log has shape {tuple(phy2log.shape)}; this layer has "
                             f"{self.num_slots} physical slots")
        if phy2log.min() < 0 or phy2log.max() >= self.num_experts:
            raise ValueError(f"phy2log names experts outside [0, {self.num_experts})")
        count = torch.bincount(phy2log, minlength=self.num_experts)
        if (count == 0).any():
            missing = torch.nonzero(count == 0).flatten().tolist()
            raise ValueError(f"phy2log leaves expert(s) {missing} without a slot")
        log2phy = torch.full(self.log2phy.shape, -1, dtype=torch.long)
        seen = [0] * self.num_experts
        for slot, e in enumerate(phy2log.tolist()):
            log2phy[e, seen[e]] = slot
            seen[e] += 1
        self.phy2log.copy_(phy2log)
        self.log2phy.copy_(log2phy)
        self.logcnt.copy_(count)

    @torch.no_grad()
    def take_load(self) -> torch.Tensor:
        """Pairs this rank routed to each physical slot [P] since the last call; resets the counters."""
        load = self.load.clone()
        self.load.zero_()
        return load

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                run_experts: RunExperts) -> torch.Tensor:
        # x: [T, H]; topk_weights [T, K] float32; topk_ids [T, K] logical experts -> [T, H]
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError("expert-parallel MoE layers read split sizes on the host and cannot "
                                      "be captured in a CUDA graph yet; run eager (enforce_eager=True)")
        t = x.shape[0]
        token = torch.arange(t, device=x.device).unsqueeze(1)                       # [T, 1]
        replica = token % self.logcnt[topk_ids]                                     # [T, K]
        slots = self.log2phy[topk_ids, replica]                                     # [T, K]
        self.load += torch.bincount(slots.flatten(), minlength=self.num_slots)
        if self.config.dispatch == "alltoall":
            pairs = self._alltoall(x, topk_weights, slots, run_experts)
        else:
            counts = self._token_counts(t, x.device)                                # [ep]
            if self.config.dispatch == "allgather" or max(counts) <= self.config.allgather_max_tokens:
                pairs = self._allgather(x, topk_weights, slots, counts, run_experts)
            else:
                pairs = self._alltoall(x, topk_weights, slots, run_experts)
        return combine(pairs, topk_ids, x.dtype)

    def _token_counts(self, t: int, device: torch.device) -> list[int]:
        """Every rank's token count this forward (the same list on all ranks)."""
        if self.group.size == 1:
            return [t]
        mine = torch.tensor([t], dtype=torch.long, device=device)
        counts = torch.empty(self.group.size, dtype=torch.long, device=device)
        _all_gather_tensor(counts, mine, group=self.group.group)
        return counts.tolist()

    def _run_local(self, x: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                   run_experts: RunExperts) -> torch.Tensor:
        # x [N, H], weights [N], slots [N] (this rank's) -> [N, H] each pair's weighted output
        if slots.numel() == 0:
            return x.new_empty(0, x.shape[1])
        return run_experts(x, weights.unsqueeze(1), (slots - self.first_slot).unsqueeze(1))

    def _allgather(self, x: torch.Tensor, topk_weights: torch.Tensor, slots: torch.Tensor,
                   counts: list[int], run_experts: RunExperts) -> torch.Tensor:
        # -> [T, K, H] this rank's pairs' outputs
        t, k = slots.shape
        size, width = self.group.size, max(counts)
        if size == 1:
            all_x, all_w, all_s = x, topk_weights, slots
        else:
            # Padding rows carry slot -1: no rank runs them.
            all_x = _all_gather_padded(x, width, 0.0, self.group)                  # [ep*W, H]
            all_w = _all_gather_padded(topk_weights, width, 0.0, self.group)       # [ep*W, K]
            all_s = _all_gather_padded(slots, width, -1, self.group)               # [ep*W, K]
        mine = (all_s >= self.first_slot) & (all_s < self.first_slot + self.slots_per_rank)
        tok, kk = torch.nonzero(mine, as_tuple=True)                                # [N]
        out = self._run_local(all_x[tok], all_w[tok, kk], all_s[tok, kk], run_experts)
        pairs = x.new_zeros(all_s.shape[0], k, x.shape[1])                          # [ep*W, K, H]
        pairs[tok, kk] = out
        if size == 1:
            return pairs
        own = x.new_empty(width, k, x.shape[1])
        _reduce_scatter_tensor(own, pairs, group=self.group.group)
        return own[:t]

    def _alltoall(self, x: torch.Tensor, topk_weights: torch.Tensor, slots: torch.Tensor,
                  run_experts: RunExperts) -> torch.Tensor:
        # -> [T, K, H] this rank's pairs' outputs
        t, k = slots.shape
        flat = slots.flatten()                                                      # [T*K]
        dest = flat // self.slots_per_rank                                          # [T*K]
        order = torch.sort(dest, stable=True).indices                               # pairs by rank
        send = torch.bincount(dest, minlength=self.group.size)                      # [ep]
        rows = x[order // k]                                                        # [T*K, H]
        weights = topk_weights.flatten()[order]
        sent_slots = flat[order]
        if self.group.size == 1:
            out = self._run_local(rows, weights, sent_slots, run_experts)
        else:
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=self.group.group)
            send_sizes, recv_sizes = send.tolist(), recv.tolist()
            got_x = _all_to_all(rows, recv_sizes, send_sizes, self.group)
            got_w = _all_to_all(weights, recv_sizes, send_sizes, self.group)
            got_s = _all_to_all(sent_slots, recv_sizes, send_sizes, self.group)
            done = self._run_local(got_x, got_w, got_s, run_experts)
            out = _all_to_all(done, send_sizes, recv_sizes, self.group)
        pairs = torch.empty_like(out)
        pairs[order] = out
        return pairs.view(t, k, x.shape[1])


def combine(pairs: torch.Tensor, topk_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's K pair outputs [T, K, H] summed in float32 in ascending logical expert order
    (``topk_ids`` [T, K]), rounded once to ``dtype`` -> [T, H]."""
    order = torch.sort(topk_ids, dim=1, stable=True).indices                        # [T, K]
    ordered = pairs.gather(1, order.unsqueeze(-1).expand_as(pairs))                  # [T, K, H]
    out = torch.zeros(pairs.shape[0], pairs.shape[2], dtype=torch.float32, device=pairs.device)
    for k in range(pairs.shape[1]):
        out += ordered[:, k].float()
    return out.to(dtype)


def _all_gather_padded(t: torch.Tensor, width: int, fill: float | int, group: Group) -> torch.Tensor:
    """Every rank's ``t`` [n_r, ...] padded to ``width`` rows with ``fill`` -> [ep * width, ...]."""
    padded = t.new_full((width, *t.shape[1:]), fill)
    padded[:t.shape[0]] = t
    out = t.new_empty(group.size * width, *t.shape[1:])
    _all_gather_tensor(out, padded.contiguous(), group=group.group)
    return out


def _all_to_all(t: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: Group) -> torch.Tensor:
    """Rows of ``t`` (in_sizes[r] of them for rank r, in rank order) to their ranks; receives
    out_sizes[r] rows from rank r -> [sum(out_sizes), ...]."""
    out = t.new_empty(sum(out_sizes), *t.shape[1:])
    dist.all_to_all_single(out, t.contiguous(), out_sizes, in_sizes, group=group.group)
    return out
