"""Expert-parallel load balancing (EPLB): where each routed expert's replicas go, from
per-expert load statistics. DeepSeek's published algorithm (deepseek-ai/EPLB), written
here from its description, with the same inputs, outputs and choices, so its README example
gives its documented placement (tests/unit/test_eplb.py).

``rebalance_experts(weight [L, E], num_replicas R, num_groups, num_nodes, num_gpus)``:

- **hierarchical** (``num_groups % num_nodes == 0``; DeepSeek uses it for prefill, at
  smaller expert-parallel sizes): (1) the expert groups are packed onto nodes, each node
  taking ``num_groups / num_nodes`` of them, balancing the groups' summed load (so a group's
  experts share a node, as group-limited routing wants); (2) inside each node its experts
  are replicated up to ``R / num_nodes`` physical slots, each extra slot going to the expert
  with the largest load per replica; (3) the node's physical experts (each carrying its
  expert's load divided by its replica count) are packed onto the node's GPUs,
  ``R / num_gpus`` a GPU, balancing their load;
- **global** (otherwise; DeepSeek's choice for decode, at larger sizes): the same with one
  group and one node, replicas placed anywhere.

Packing is greedy longest-first: items by descending load (a stable order, so equal loads
keep their index order), each into the lightest pack that still has room.

Outputs: ``phy2log [L, R]`` the logical expert of each physical slot (slot s lives on GPU
``s // (R / num_gpus)``), ``log2phy [L, E, R - E + 1]`` each expert's slots (-1 padded),
``logcnt [L, E]`` its replica count. Load prediction (e.g. a moving average of routed token
counts) is the caller's.
"""

from __future__ import annotations

import torch


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The placement of ``weight``'s experts (see the module docstring) -> (phy2log [L, R],
    log2phy [L, E, R - E + 1], logcnt [L, E]), all int64 on the CPU."""
    num_layers, num_experts = weight.shape
    if num_replicas < num_experts:
        raise ValueError(f"num_replicas={num_replicas} is fewer than the {num_experts} experts")
    if num_gpus % num_nodes or num_replicas % num_gpus:
        raise ValueError(f"num_gpus={num_gpus} must be a multiple of num_nodes={num_nodes}, and "
                         f"num_replicas={num_replicas} a multiple of num_gpus")
    if num_experts % num_groups:
        raise ValueError(f"the {num_experts} experts do not split into num_groups={num_groups} groups")
    weight = weight.float().cpu()
    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = _hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, rank, logcnt = _hierarchical(weight, num_replicas, 1, 1, num_gpus)
    width = num_replicas - num_experts + 1
    log2phy = torch.full((num_layers, num_experts * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, phy2log * width + rank, torch.arange(num_replicas).expand(num_layers, -1))
    return phy2log, log2phy.view(num_layers, num_experts, width), logcnt


def _pack(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Items [X, n] (n a multiple of num_packs) into num_packs packs of n / num_packs items
    -> (pack of each item [X, n], its index within the pack [X, n])."""
    rows, n = weight.shape
    per_pack = n // num_packs
    if per_pack == 1:
        index = torch.arange(n).expand(rows, n).clone()
        return index, torch.zeros_like(index)
    pack = torch.empty(rows, n, dtype=torch.int64)
    slot = torch.empty(rows, n, dtype=torch.int64)
    order = torch.sort(weight, dim=-1, descending=True, stable=True).indices
    for r in range(rows):
        loads, counts = [0.0] * num_packs, [0] * num_packs
        for item in order[r].tolist():
            p = min((q for q in range(num_packs) if counts[q] < per_pack), key=loads.__getitem__)
            pack[r, item], slot[r, item] = p, counts[p]
            loads[p] += float(weight[r, item])
            counts[p] += 1
    return pack, slot


def _replicate(weight: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts [X, n] onto num_slots >= n slots: slot i < n holds expert i; each further slot
    the expert with the largest load per replica -> (expert of each slot [X, S], its replica
    index [X, S], replicas of each expert [X, n])."""
    rows, n = weight.shape
    expert = torch.arange(num_slots).expand(rows, num_slots).clone()
    replica = torch.zeros(rows, num_slots, dtype=torch.int64)
    count = torch.ones(rows, n, dtype=torch.int64)
    r = torch.arange(rows)
    for i in range(n, num_slots):
        best = (weight / count).max(dim=-1).indices
        expert[:, i], replica[:, i] = best, count[r, best]
        count[r, best] += 1
    return expert, replica, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm))
    return inv


def _hierarchical(weight: torch.Tensor, num_slots: int, num_groups: int, num_nodes: int,
                  num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layers, experts = weight.shape
    group_size = experts // num_groups
    per_node = experts // num_nodes                 # experts a node holds (its groups')
    slots_per_gpu = num_slots // num_gpus
    # 1. groups -> nodes; "node-major" expert ids: node 0's groups first, in pack order.
    group_load = weight.view(layers, num_groups, group_size).sum(-1)               # [L, G]
    node, in_node = _pack(group_load, num_nodes)
    first = (node * (num_groups // num_nodes) + in_node) * group_size             # [L, G]
    to_major = (first.unsqueeze(-1) + torch.arange(group_size)).flatten(1)        # [L, E]
    from_major = _inverse(to_major)
    # 2. replicate inside each node: rows are (layer, node).
    node_load = weight.gather(1, from_major).view(-1, per_node)                    # [L*N, E/N]
    slot_expert, slot_replica, count = _replicate(node_load, num_slots // num_nodes)
    # 3. a node's slots -> its GPUs, each slot carrying its expert's load per replica.
    slot_load = (node_load / count).gather(1, slot_expert)                         # [L*N, R/N]
    gpu, in_gpu = _pack(slot_load, num_gpus // num_nodes)
    placed = _inverse(gpu * slots_per_gpu + in_gpu)                                # placed slot -> node slot
    expert_major = slot_expert.gather(1, placed).view(layers, num_nodes, -1)
    expert_major = (expert_major + torch.arange(0, experts, per_node).view(1, -1, 1)).flatten(1)
    phy2log = from_major.gather(1, expert_major)                                   # [L, R]
    rank = slot_replica.gather(1, placed).view(layers, -1)
    logcnt = count.view(layers, -1).gather(1, to_major)                           # [L, E]
    return phy2log, rank, logcnt
