"""Expert parallelism in one process (EP size 1): the dispatch/combine code, replica choice,
load counters, weight moves and the EPLB schedule, against the single-device experts; and
what each rank of a larger group loads (construction and loading need no communication)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors import safe_open
from torch import nn

from deepinfer.kernels import reference
from deepinfer.layers.deepseek_v4_moe import DeepseekV4Experts
from deepinfer.layers.moe import FusedMoE
from deepinfer.parallel.balancer import EPLBConfig, ExpertLoadBalancer, move_experts
from deepinfer.parallel.expert import (ExpertParallel, ExpertParallelConfig, combine, initial_placement,
                                       use_expert_parallel)
from deepinfer.models.loader import checkpoint_files
from deepinfer.parallel.groups import Group
from tests.parallel.ep_harness import (V41_CHECKPOINT, EPRun, load, moe_layers, write_hf_checkpoint,
                                       write_v4_checkpoint)

E, H, I, T, K = 6, 16, 8, 11, 2


def routing(seed: int, skew: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], softmax top-K weights and ids [T, K]; ``skew`` favours expert 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    logits[:, 0] += skew
    weights, ids = logits.softmax(-1).topk(K)
    return x, weights, ids


def experts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * I, H, generator=g) / 4, torch.randn(E, H, I, generator=g) / 3


def build(num_redundant: int, dispatch: str, cls=FusedMoE, **kwargs) -> FusedMoE:
    """An expert-parallel layer at EP size 1 holding the experts of :func:`experts` in its
    initial placement."""
    with use_expert_parallel(ExpertParallelConfig(num_redundant, dispatch)):
        layer = cls(E, H, I, **kwargs)
    gate_up, down = experts()
    slots = initial_placement(E, E + num_redundant)
    with torch.no_grad():
        layer.gate_up_proj.copy_(gate_up[slots])
        layer.down_proj.copy_(down[slots])
    return layer


@pytest.mark.parametrize("dispatch", ["allgather", "alltoall"])
def test_identity_placement_is_bitwise_the_single_device_layer(dispatch):
    """One rank, no redundancy: the same rows reach each expert in the same order and the
    combine adds them in the reference's order, so the bits are the reference's."""
    x, w, ids = routing(1)
    gate_up, down = experts()
    ep = ExpertParallel(E, Group(), ExpertParallelConfig(dispatch=dispatch))
    out = ep(x, w, ids, lambda *pair: reference.moe_experts(pair[0], gate_up, down, *pair[1:]))
    assert torch.equal(out, reference.moe_experts(x, gate_up, down, w, ids))


@pytest.mark.parametrize("dispatch", ["allgather", "alltoall"])
def test_replicas_and_counters(dispatch):
    x, w, ids = routing(2)
    layer = build(3, dispatch)                       # slots hold experts 0..5, then 0, 1, 2
    ref = reference.moe_experts(x, *experts(), w, ids)
    assert (layer(x, w, ids) - ref).abs().max() <= 1e-5 * ref.abs().max()
    load = layer.ep.take_load()
    assert int(load.sum()) == T * K
    # Per logical expert, its pairs; replicas share them by token index (t mod replicas).
    per_expert = torch.zeros(E, dtype=torch.long).index_add_(0, layer.ep.phy2log, load)
    assert torch.equal(per_expert, torch.bincount(ids.flatten(), minlength=E))
    for e in range(3):
        tokens = torch.nonzero((ids == e).any(1)).flatten()
        assert load[e] == int((tokens % 2 == 0).sum()) and load[E + e] == int((tokens % 2 == 1).sum())
    assert int(layer.ep.take_load().sum()) == 0


def test_clamped_experts_route_through_dispatch():
    x, w, ids = routing(3)
    layer = build(2, "alltoall", DeepseekV4Experts, swiglu_limit=0.5)
    ref = reference.clamped_moe_experts(x, *experts(), w, ids, 0.5)
    assert (layer(x, w, ids) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_combine_sums_in_logical_expert_order():
    pairs = torch.tensor([[[1e8], [-1e8], [1.0]]])                  # [T=1, K=3, H=1]
    assert combine(pairs, torch.tensor([[0, 1, 2]]), torch.float32).item() == 1.0   # (1e8 - 1e8) + 1
    assert combine(pairs, torch.tensor([[1, 2, 0]]), torch.float32).item() == 0.0   # (1 + 1e8) - 1e8


def test_move_experts_follows_the_new_placement():
    x, w, ids = routing(4)
    layer = build(3, "allgather")
    before = layer(x, w, ids)
    new = torch.tensor([5, 4, 3, 2, 1, 0, 5, 5, 2])
    move_experts(layer, new)
    gate_up, down = experts()
    assert torch.equal(layer.gate_up_proj.data, gate_up[new]) and torch.equal(layer.down_proj.data, down[new])
    assert torch.equal(layer.ep.phy2log, new) and layer.ep.logcnt.tolist() == [1, 1, 2, 1, 1, 3]
    assert (layer(x, w, ids) - before).abs().max() <= 1e-5 * before.abs().max()


class TwoLayers(nn.Module):
    def __init__(self, num_redundant: int) -> None:
        super().__init__()
        self.a, self.b = build(num_redundant, "auto"), build(num_redundant, "alltoall")

    def forward(self, x, w, ids):
        return self.a(x, w, ids) + self.b(x, w, ids)


def test_balancer_replicates_the_hot_expert_without_changing_outputs():
    model = TwoLayers(3)
    balancer = ExpertLoadBalancer(model, EPLBConfig(window_size=2, interval=3))
    x, w, ids = routing(5, skew=4.0)                # expert 0 in every token's top-2
    first = model(x, w, ids)
    assert [balancer.step() for _ in range(2)] == [False, False]
    assert balancer.stats.rebalances == 0 and balancer.stats.steps_since_rebalance == 2
    model(x, w, ids)
    assert balancer.step()                           # third step: rebalance
    for layer in (model.a, model.b):
        assert layer.ep.logcnt[0] >= 2              # the hot expert got replicas
        gate_up, _ = experts()
        assert torch.equal(layer.gate_up_proj.data, gate_up[layer.ep.phy2log])
    stats = balancer.stats
    assert stats.rebalances == 1 and stats.steps_since_rebalance == 0
    # One rank: max/mean per rank is 1 by definition.
    assert stats.imbalance_before == stats.imbalance_after == 1.0
    assert (model(x, w, ids) - first).abs().max() <= 1e-5 * first.abs().max()


def test_loading_a_placement_with_two_local_replicas_is_refused():
    layer = build(1, "auto")                         # 7 slots on one rank: expert 0 twice
    with pytest.raises(NotImplementedError, match="expert 0 has 2 slots on this rank"):
        layer.expert_weight_index("gate_proj", 0)
    assert layer.expert_weight_index("down_proj", 5) == ("down_proj", (5,))


def test_plain_layer_outside_expert_parallelism():
    assert FusedMoE(E, H, I).ep is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_redundant_experts=-1), "num_redundant_experts=-1 must be >= 0"),
    (dict(dispatch="ring"), "dispatch='ring' is not a dispatch mode"),
    (dict(allgather_max_tokens=-2), "allgather_max_tokens=-2 must be >= 0"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExpertParallelConfig(**kwargs)


@pytest.mark.parametrize("field", ["window_size", "interval", "num_nodes", "num_groups"])
def test_eplb_config_errors(field):
    with pytest.raises(ValueError, match=f"EPLB {field}=0 must be >= 1"):
        EPLBConfig(**{field: 0})


def test_slots_must_split_over_the_group():
    # A stand-in process group: construction checks sizes before any communication.
    group = Group(4, 1, group=object())
    with pytest.raises(ValueError, match="6 routed experts \\+ num_redundant_experts=1 = 7 slots"):
        ExpertParallel(E, group, ExpertParallelConfig(num_redundant_experts=1))
    assert ExpertParallel(E, group, ExpertParallelConfig(num_redundant_experts=2)).local_experts() == [2, 3]


@pytest.mark.parametrize("phy2log, message", [
    ([0, 1, 2, 3, 4, 4, 0, 1, 2], "leaves expert\\(s\\) \\[5\\] without a slot"),
    ([0, 1, 2, 3, 4, 6, 0, 1, 2], "names experts outside \\[0, 6\\)"),
    ([0, 1, 2, 3, 4, 5], "has shape \\(6,\\); this layer has 9 physical slots"),
])
def test_bad_placements(phy2log, message):
    layer = build(3, "auto")
    with pytest.raises(ValueError, match=message):
        layer.ep.set_placement(torch.tensor(phy2log))


def test_balancer_needs_expert_parallel_layers():
    with pytest.raises(ValueError, match="EPLB needs expert-parallel MoE layers"):
        ExpertLoadBalancer(nn.Sequential(FusedMoE(E, H, I)), EPLBConfig())


def _expert_of(name: str) -> int | None:
    m = re.search(r"\.experts\.(\d+)\.", name)
    return None if m is None else int(m[1])


@pytest.mark.parametrize("name", ["v41", "Qwen3MoeForCausalLM", "v4"])
def test_each_rank_loads_and_reads_only_its_experts(name, tmp_path):
    """Ranks 0 and 1 of an EP group of 2 (a stand-in process group: loading communicates
    nothing) load V4.1 (FP8/FP4, per-expert tensors and scales), Qwen3-MoE (per-expert) and V4
    (whole stacked tensors, split per expert): each slot holds its expert's weights, and the
    loader leaves exactly the other rank's per-expert tensors unread."""
    path = {"v41": V41_CHECKPOINT, "v4": None}.get(name)
    if name == "v4":
        path = write_v4_checkpoint(tmp_path / "v4")
    elif path is None:
        path = write_hf_checkpoint(name, tmp_path / name)
    single = load(path, EPRun(), Group())
    names = [n for file in checkpoint_files(str(path)) for n in safe_open(str(file), "pt").keys()]
    for rank in range(2):
        model = load(path, EPRun(), Group(2, rank, group=object()))
        for plain, layer in zip(moe_layers(single), moe_layers(model)):
            experts = layer.ep.local_experts()
            assert experts == list(range(rank * 4, rank * 4 + 4))
            assert torch.equal(layer.gate_up_proj, plain.gate_up_proj[experts])
            assert torch.equal(layer.down_proj, plain.down_proj[experts])
        # The checkpoint's own (not the drafter's, mtp.*) per-expert tensors of the other rank.
        expected = {n for n in names if _expert_of(n) is not None and not n.startswith("mtp.")
                    and _expert_of(n) // 4 != rank}
        assert {n for n in names if model.skips_tensor(n)} == expected
        assert bool(expected) == (name != "v4")
