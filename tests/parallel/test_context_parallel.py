"""Context parallelism on the CPU: the zigzag split (every token once, balanced causal work,
token order restored), sizes and models refused before anything loads, and whole engines at
cp=2 (and ep=2 x cp=2 on the MoE models) on two gloo worker processes against the
single-process run: greedy tokens equal and float32 prompt and sample logprobs within 1e-5,
with prompt lengths not divisible by 2 * cp, under chunked prefill and whole-prompt steps."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import ParallelConfig
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.parallel.context import Piece, split_tokens, token_layout, zigzag_chunks
from tests.engine.conftest import make_checkpoint
from tests.parallel.shapes import ENGINE_OPTIONS, LOGPROB_TOL, MOE, TINY_V4, V3

NEW_TOKENS = 6


# -- the split ----------------------------------------------------------------------------------
def _starts(lens: list[int]) -> list[int]:
    return [0, *np.cumsum(lens).tolist()]


def test_zigzag_chunks_cut_n_tokens_into_2cp_nearly_equal_runs():
    for n, cp in [(4, 2), (19, 2), (1000, 4), (13, 3)]:
        chunks = zigzag_chunks(n, cp)
        assert len(chunks) == 2 * cp and chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        sizes = [e - s for s, e in chunks]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("lens, cp", [([19], 2), ([5, 1, 40, 3, 1], 2), ([1000], 4), ([7, 13, 2], 3),
                                      ([1, 0, 4], 2)])
def test_split_covers_every_token_once_and_restores_order(lens, cp):
    starts = _starts(lens)
    pieces = split_tokens(starts, cp)
    assert pieces is not None and len(pieces) == cp
    total = starts[-1]
    owner, local = token_layout(pieces, total)
    for r, mine in enumerate(pieces):
        assert [p.start for p in mine] == sorted(p.start for p in mine)
        for p in mine:
            # A piece never crosses its sequence's bounds.
            assert starts[p.seq] <= p.start < p.end <= starts[p.seq + 1]
        assert (owner == r).sum() == sum(p.end - p.start for p in mine)
    # Gathering: every rank's rows padded to the widest, concatenated in rank order, then
    # indexed by owner * width + local gives back the step's rows in token order.
    x = torch.randn(total, 3)
    width = int(np.bincount(owner, minlength=cp).max())
    padded = []
    for mine in pieces:
        rows = torch.cat([x[p.start:p.end] for p in mine])
        padded.append(torch.cat([rows, torch.zeros(width - len(rows), 3)]))
    gathered = torch.cat(padded)
    assert torch.equal(gathered[torch.from_numpy(owner * width + local)], x)


def test_zigzag_balances_causal_attention_work():
    # A token at position p attends to p + 1 keys: with 2 * cp chunks paired i / 2cp-1-i every
    # rank's share costs the same (to a chunk's rounding), where cutting the prompt into cp
    # consecutive runs would give the last rank about 2 * cp - 1 times the first one's work.
    for n, cp in [(1000, 4), (4093, 2), (517, 3)]:
        pieces = split_tokens([0, n], cp)
        work = [sum(sum(range(p.start + 1, p.end + 1)) for p in mine) for mine in pieces]
        tokens = [sum(p.end - p.start for p in mine) for mine in pieces]
        assert max(tokens) - min(tokens) <= 2
        assert max(work) / min(work) < 1 + 4 * cp / n
        consecutive = [sum(range(n * r // cp + 1, n * (r + 1) // cp + 1)) for r in range(cp)]
        assert max(consecutive) / min(consecutive) > 2 * cp - 2


def test_steps_without_a_prefill_run_whole_on_every_rank_and_short_rows_balance():
    assert split_tokens([0, 1, 2, 3], 2) is None              # decode rows
    assert split_tokens([0, 3, 4], 2) is None                 # nothing reaches 2 * cp tokens
    assert split_tokens([0, 9], 1) is None                    # one rank
    pieces = split_tokens(_starts([8, 3, 1, 1]), 2)
    # The prefill split 4 + 4; then the 3-token row to rank 0, the single rows to rank 1.
    assert pieces == [[Piece(0, 0, 2), Piece(0, 6, 8), Piece(1, 8, 11)],
                      [Piece(0, 2, 6), Piece(2, 11, 12), Piece(3, 12, 13)]]
    with pytest.raises(ValueError, match="leave token 3 of 4 to no rank"):
        token_layout([[Piece(0, 0, 3)], []], 4)
    with pytest.raises(ValueError, match="overlaps another"):
        token_layout([[Piece(0, 0, 3)], [Piece(0, 2, 4)]], 4)


# -- sizes and models refused ---------------------------------------------------------------------
def test_parallel_config_layout_and_refusals():
    par = ParallelConfig(cp=2, ep=2)
    assert par.world_size == 2
    assert par.describe() == ("world=2; cp=2 (context-parallel groups of ranks [0..1]); "
                              "ep=2 (expert-parallel groups of ranks [0..1])")
    assert ParallelConfig(cp=2, ep=4).world_size == 4
    assert ParallelConfig().describe() == "world=1; one rank, no parallelism"
    with pytest.raises(ValueError, match=r"cp=2 \(context_parallel_size\) must divide the world of 3"):
        ParallelConfig(cp=2, ep=3)


def test_unsupported_models_and_modes_are_refused_before_loading(tmp_path):
    mtp = make_checkpoint(tmp_path, "DeepseekV3ForCausalLM", **V3)
    with pytest.raises(NotImplementedError, match="context_parallel_size=2 with prefill_truncation_mode='exact'"):
        LLM(model=DEFAULT_MODEL, device="cpu", context_parallel_size=2, yoco_prefill_truncation_mode="exact")
    with pytest.raises(NotImplementedError, match="model drafters are not yet supported under parallelism"):
        LLM(model=str(mtp), device="cpu", context_parallel_size=2, speculative_config={"method": "mtp"})
    assert not mp.active_children()


def test_context_parallelism_is_refused_for_a_model_without_it(checkpoints, monkeypatch):
    # Every registered family gathers its K/V now; a model that does not says so by name.
    from deepinfer.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "supports_context_parallel", False)
    with pytest.raises(NotImplementedError, match="context_parallel_size=2: LlamaForCausalLM does not support "
                                                  "context parallelism yet"):
        LLM(model=str(checkpoints["LlamaForCausalLM"]), device="cpu", context_parallel_size=2)
    assert not mp.active_children()


# -- whole engines ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cp")
    return {"LlamaForCausalLM": make_checkpoint(root, "LlamaForCausalLM", attention_bias=True),
            "Qwen3ForCausalLM": make_checkpoint(root, "Qwen3ForCausalLM", head_dim=16),
            "Qwen3MoeForCausalLM": make_checkpoint(root, "Qwen3MoeForCausalLM", **MOE),
            "DeepseekV3ForCausalLM": make_checkpoint(root, "DeepseekV3ForCausalLM", **V3),
            "DeepseekV4ForCausalLM": TINY_V4, "DeepseekV41ForCausalLM": Path(DEFAULT_MODEL)}


def _prompts() -> list[list[int]]:
    # None of the lengths divides by 2 * cp = 4; the 3-token prompt is never split.
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 3, 19, 42)]


def _run(path: Path, budget: int, **options) -> tuple[list[list[int]], list[list[dict]], int]:
    """Greedy tokens with prompt and sample logprobs under a token budget of ``budget`` per
    step (then the same prompts twice more, whose prefixes hit the cache: their greedy tokens
    must not change), and how many steps rank 0 ran as a context-parallel share (0 on one
    process)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=3,
                            logprobs=3)
    with LLM(model=str(path), device="cpu", max_num_batched_tokens=budget, dtype="float32", **options) as llm:
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        for _ in range(2):
            again = llm.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                            ignore_eos=True), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
        runner = llm.engine.runner
        split = runner.cp_split_steps if not hasattr(runner, "_call_all") else \
            runner._call_all("__getattribute__", "cp_split_steps")[0]
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in pos.items()} for pos in o.prompt_logprobs[1:] + o.outputs[0].logprobs]
                for o in outs]
    return tokens, logprobs, split


_reference: dict[tuple[str, int], tuple] = {}


def _check(checkpoints: dict[str, Path], arch: str, budget: int, **options) -> None:
    options.update(ENGINE_OPTIONS.get(arch, {}))
    if (arch, budget) not in _reference:
        _reference[arch, budget] = _run(checkpoints[arch], budget, **ENGINE_OPTIONS.get(arch, {}))
    ref_tokens, ref_logprobs, ref_split = _reference[arch, budget]
    tokens, logprobs, split = _run(checkpoints[arch], budget, **options)
    assert ref_split == 0 and split > 0
    assert tokens == ref_tokens
    for ref_seq, seq in zip(ref_logprobs, logprobs):
        assert len(seq) == len(ref_seq)
        for ref_pos, pos in zip(ref_seq, seq):
            common = ref_pos.keys() & pos.keys()
            assert len(common) >= len(ref_pos) - 1
            for t in common:
                assert abs(ref_pos[t] - pos[t]) <= LOGPROB_TOL, (t, ref_pos[t], pos[t])


def test_context_parallel_llama_equals_single_process(checkpoints):
    # Chunked prefill (16 tokens a step): chunks split over the two ranks beside decode rows.
    _check(checkpoints, "LlamaForCausalLM", 16, context_parallel_size=2)


def test_context_parallel_moe_with_expert_parallelism_equals_single_process(checkpoints):
    # --ep 2 --cp 2 on a MoE model, chunked: each rank's own tokens through the expert dispatch.
    _check(checkpoints, "Qwen3MoeForCausalLM", 16, context_parallel_size=2, expert_parallel_size=2)


@pytest.mark.slow
@pytest.mark.parametrize("arch, budget, ep", [
    ("LlamaForCausalLM", 128, 1), ("Qwen3ForCausalLM", 16, 1), ("Qwen3MoeForCausalLM", 16, 1),
    ("Qwen3MoeForCausalLM", 128, 2), ("DeepseekV3ForCausalLM", 16, 1),
    ("DeepseekV3ForCausalLM", 16, 2), ("DeepseekV3ForCausalLM", 128, 2), ("DeepseekV4ForCausalLM", 16, 1),
    ("DeepseekV4ForCausalLM", 16, 2), ("DeepseekV4ForCausalLM", 128, 2), ("DeepseekV41ForCausalLM", 16, 1),
    ("DeepseekV41ForCausalLM", 16, 2), ("DeepseekV41ForCausalLM", 128, 2)])
def test_context_parallel_engine_equals_single_process(checkpoints, arch, budget, ep):
    _check(checkpoints, arch, budget, context_parallel_size=2, expert_parallel_size=ep)


@pytest.mark.slow
def test_four_context_parallel_ranks_equal_single_process(checkpoints):
    # 8 chunks a split sequence; the 5-token prompt and the decode rows go whole to one rank.
    _check(checkpoints, "Qwen3MoeForCausalLM", 64, context_parallel_size=4, expert_parallel_size=2)
