"""EPLB's placement function: DeepSeek's published README example, and on random loads every
expert placed, the maps consistent, and the busiest GPU's load not above a plain placement's."""

from __future__ import annotations

import pytest
import torch

from deepinfer.parallel.eplb import rebalance_experts

README_WEIGHT = torch.tensor([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
# deepseek-ai/EPLB README: 2 layers x 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
README_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                  [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """[L, num_gpus]: each replica serves its expert's load / replicas."""
    per_slot = weight.float().gather(1, phy2log) / logcnt.gather(1, phy2log)
    return per_slot.view(weight.shape[0], num_gpus, -1).sum(-1)


def check_consistent(weight, num_replicas, phy2log, log2phy, logcnt) -> None:
    layers, experts = weight.shape
    assert phy2log.shape == (layers, num_replicas) and logcnt.shape == (layers, experts)
    assert (logcnt >= 1).all() and (logcnt.sum(-1) == num_replicas).all()
    for layer in range(layers):
        for e in range(experts):
            slots = [s for s in log2phy[layer, e].tolist() if s >= 0]
            assert len(slots) == logcnt[layer, e]
            assert all(phy2log[layer, s] == e for s in slots)


def test_the_published_example():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, num_groups=4, num_nodes=2, num_gpus=8)
    assert phy2log.tolist() == README_PHY2LOG
    check_consistent(README_WEIGHT, 16, phy2log, log2phy, logcnt)
    # The four busiest experts of layer 0 got the four redundant slots.
    assert sorted(torch.nonzero(logcnt[0] > 1).flatten().tolist()) == [1, 4, 5, 10]


@pytest.mark.parametrize("groups, nodes, gpus, replicas", [(4, 2, 8, 32), (3, 2, 4, 16), (1, 1, 4, 24), (8, 4, 8, 40)])
def test_random_loads(groups, nodes, gpus, replicas):
    """Hierarchical (groups divisible by nodes) and global (3 groups on 2 nodes): every
    expert placed, each GPU given replicas / gpus slots, and the busiest GPU no busier than
    with each expert once, in order, and no redundant slots."""
    gen = torch.Generator().manual_seed(groups * 100 + replicas)
    experts = 24 if groups != 3 else 12
    weight = (torch.rand(3, experts, generator=gen) ** 3 * 1000).round().long()   # skewed
    phy2log, log2phy, logcnt = rebalance_experts(weight, replicas, groups, nodes, gpus)
    check_consistent(weight, replicas, phy2log, log2phy, logcnt)
    balanced = gpu_loads(weight, phy2log, logcnt, gpus).amax(-1)
    plain = weight.float().view(3, gpus, -1).sum(-1).amax(-1) if experts % gpus == 0 else None
    if plain is not None:
        assert (balanced <= plain + 1e-3).all()
    if replicas > experts:
        hottest = weight.argmax(-1)
        assert (logcnt.gather(1, hottest[:, None]) >= 2).all()


def test_sizes_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="num_replicas=18 a multiple of num_gpus"):
        rebalance_experts(README_WEIGHT, 18, 4, 2, 8)
    with pytest.raises(ValueError, match="fewer than the 12 experts"):
        rebalance_experts(README_WEIGHT, 8, 4, 2, 8)
    with pytest.raises(ValueError, match="num_groups=5"):
        rebalance_experts(README_WEIGHT, 16, 5, 1, 8)
