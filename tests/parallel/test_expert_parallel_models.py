"""Expert parallelism in several gloo processes: one layer whose ranks each bring their own
tokens, and whole tiny models: 2 and 4 gloo processes, each loading only its own
experts from the checkpoint, give the single-process model's log-probabilities (float32, within
1e-5) and greedy tokens on DeepSeek-V4 (a hash-routed layer), V4.1 (FP8/FP4 checkpoint), V3
and Qwen3-MoE; on both dispatch paths; and EPLB rebalancing in the middle of generation
(weights moved between ranks) changes no output."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import reference
from deepinfer.parallel.expert import ExpertParallelConfig, initial_placement
from deepinfer.parallel.groups import Group
from tests.parallel.ep_harness import (V41_CHECKPOINT, EPRun, expected_pairs, layer_experts, layer_inputs,
                                       load, moe_layers, random_seqs, rank_layer_runs, rank_runs, spawn,
                                       write_hf_checkpoint, write_v4_checkpoint)

pytest.importorskip("transformers")

ATOL = 1e-5
SEQ_LENS = [9, 5, 12]
VOCAB = 90           # prompt ids below every tiny model's vocabulary
GREEDY = 4
RUNS = [EPRun("allgather", greedy_steps=GREEDY),
        # all-to-all, two redundant slots, a rebalance before greedy steps 2 and 4
        EPRun("alltoall", num_redundant_experts=2, greedy_steps=GREEDY, rebalance_every=2)]


def checkpoint(name: str, tmp_path):
    if name == "v4":
        return write_v4_checkpoint(tmp_path / "v4")
    if name == "v41":
        return V41_CHECKPOINT
    return write_hf_checkpoint(name, tmp_path / name)


def assert_same_outputs(got: dict, ref: dict, pairs: list[int]) -> None:
    assert (got["logprobs"] - ref["logprobs"]).abs().max().item() <= ATOL
    assert got["greedy"] == ref["greedy"]
    for a, b in zip(got["step_logprobs"], ref["step_logprobs"]):
        assert (a - b).abs().max().item() <= ATOL
    # Each layer's counters: every local pair of the first forward, once (MTP layers: none).
    assert [int(c.sum()) for c in got["load"]] == pairs


def assert_weights_follow_placement(got: dict, single, rank: int) -> None:
    """After the rebalances each local slot holds exactly its expert's checkpoint weights, and
    the placement moved experts (the test is not vacuous)."""
    moved = False
    for layer, phy2log, (gate_up, down) in zip(moe_layers(single), got["placements"], got["weights"]):
        s = gate_up.shape[0]
        experts = phy2log[rank * s:(rank + 1) * s]
        assert torch.equal(gate_up, layer.gate_up_proj.data[experts])
        assert torch.equal(down, layer.down_proj.data[experts])
        moved |= not torch.equal(phy2log, initial_placement(layer.num_experts, len(phy2log)))
    assert moved


def check(path, world_size: int, runs: list[EPRun]) -> None:
    single = load(path, EPRun(), Group())
    seqs = random_seqs(SEQ_LENS, VOCAB)
    ref = rank_runs(0, 1, path, seqs, [EPRun(greedy_steps=GREEDY)])[0]
    pairs = expected_pairs(single, sum(SEQ_LENS))
    assert any(pairs)
    for rank, results in enumerate(spawn(rank_runs, world_size, path, seqs, runs)):
        for run, got in zip(runs, results):
            assert_same_outputs(got, ref, pairs)
            if run.rebalance_every:
                assert got["stats"].rebalances == GREEDY // run.rebalance_every
                assert_weights_follow_placement(got, single, rank)


@pytest.mark.slow
def test_each_rank_its_own_tokens():
    """Attention-data-parallel shape: 3 ranks with 5, 0 and 11 tokens (uneven gathers and
    splits, an idle rank), 8 experts + 1 redundant slot, on every dispatch path; each rank's
    output equals the single-device experts on its tokens."""
    tokens = [5, 0, 11]
    configs = [ExpertParallelConfig(1, "allgather"), ExpertParallelConfig(1, "alltoall"),
               ExpertParallelConfig(1, "auto", allgather_max_tokens=8)]
    for rank, outs in enumerate(spawn(rank_layer_runs, 3, tokens, configs)):
        x, w, ids = layer_inputs(rank, tokens[rank])
        ref = reference.moe_experts(x, *layer_experts(), w, ids)
        for out in outs:
            torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)


def test_ep2_qwen3_moe_matches_single_process(tmp_path):
    check(checkpoint("Qwen3MoeForCausalLM", tmp_path), 2, RUNS)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v4", "v41", "DeepseekV3ForCausalLM"])
def test_ep2_matches_single_process(name, tmp_path):
    check(checkpoint(name, tmp_path), 2, RUNS)


@pytest.mark.slow
def test_ep4_v4_matches_single_process(tmp_path):
    """Four ranks, 8 experts + 4 redundant slots (3 a rank); auto dispatch on both sides of its
    threshold (the batch grows from 26 to 35 tokens over the greedy steps)."""
    runs = [EPRun("auto", num_redundant_experts=4, greedy_steps=GREEDY, rebalance_every=2,
                  allgather_max_tokens=30),
            EPRun("alltoall", num_redundant_experts=4, greedy_steps=GREEDY, rebalance_every=1)]
    check(checkpoint("v4", tmp_path), 4, runs)
