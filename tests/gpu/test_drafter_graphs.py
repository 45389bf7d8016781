"""Model drafters (DSpark, MTP) through captured CUDA graphs on the GPU (run on the GPU machine:
``pytest -m gpu tests/gpu/test_drafter_graphs.py``).

With a graph-safe model drafter, decode and verification steps replay the bucket's graph of
the drafter's forward (the target's, with the features the drafter keeps and its context
rows written) and the proposal's graph (DraftGraphs). In float32 the tokens equal those of
the eager engine with the same drafter (``enforce_eager=True``), and the step counters show
that the drafter's steps went through the graphs: the embedded default model with its
trained DSpark drafter (full-width and varlen verification, greedy and seeded sampled
requests), a tiny DeepSeek-V4 checkpoint shipping a V4 DSpark drafter, and a tiny
DeepSeek-V3 with an MTP module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.runner.cuda_graph import DRAFT_MODES

from ..engine.test_mtp_drafter import v3_mtp_dir, v3_repeat_dir  # noqa: F401  (fixtures)
from ..models.v4_dspark_checkpoint import BLOCK as V4_BLOCK
from ..models.v4_dspark_checkpoint import PROMPTS as V4_PROMPTS
from ..models.v4_dspark_checkpoint import write_bigram_checkpoint_for

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8]
BLOCK = json.loads((Path(DEFAULT_MODEL) / "config.json").read_text())["text_config"]["dspark_block_size"]
MAX_TOKENS = [24, 8, 32, 14, 28]
TEXT = [
    "The list type is",
    "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n",
    "Run command with arguments and return a CompletedProcess instance.\n\nThe returned instance will have",
    "Open a bzip2-compressed file in binary or text mode.\n\nThe",
    "This module provides access to some objects used or maintained by the interpreter and to "
    "functions that interact strongly with the interpreter. " * 2,
]


def greedy() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


def seeded() -> list[SamplingParams]:
    """Greedy and seeded sampled requests (exact-match verification: deterministic), one with
    top-k (the filtered proposal graphs)."""
    params = greedy()
    for i, seed in ((1, 7), (2, 3), (4, 5)):
        params[i] = SamplingParams(temperature=0.8, seed=seed, max_tokens=MAX_TOKENS[i], ignore_eos=True,
                                   top_k=20 if i == 1 else 0)
    return params


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = torch.cuda.CUDAGraph.replay

    def counting(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting)
    return calls


def make_llm(model: str, spec: dict, **kwargs) -> LLM:
    return LLM(model=model, device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=160,
               block_size=4, num_kv_blocks=600, speculative_config=spec, **kwargs)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def check_graphs_match_eager(model: str, spec: dict, prompts, params, replays: list[int], **kwargs) -> None:
    eager = make_llm(model, spec, enforce_eager=True, **kwargs)
    assert eager.engine.runner.decode_graphs is None
    expected = tokens(eager, prompts, params)
    del eager
    torch.cuda.empty_cache()

    llm = make_llm(model, spec, cuda_graph_sizes=SIZES, **kwargs)
    runner = llm.engine.runner
    assert runner.decode_graphs is not None and runner.draft_graphs is not None, "graphs were captured"
    assert sorted(runner.draft_graphs.graphs) == sorted((n, m) for n in SIZES for m in DRAFT_MODES)
    replays.clear()
    got = tokens(llm, prompts, params)
    assert got == expected
    # (The drafts themselves may differ at near ties: padded batches may pick other GEMM kernels.)
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    # The drafter's steps went through the graphs: its forward and its proposal replayed.
    assert runner.drafter_graph_steps >= max(MAX_TOKENS) // 4
    assert runner.draft_graphs.steps >= runner.drafter_graph_steps - 2
    assert runner.verify_graph_steps > 0
    assert len(replays) >= runner.drafter_graph_steps + runner.draft_graphs.steps
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


@pytest.mark.parametrize("params", [greedy, seeded], ids=["greedy", "seeded"])
def test_dspark_graphs_match_eager_float32(params, replays):
    check_graphs_match_eager(DEFAULT_MODEL, {"method": "dspark", "num_speculative_tokens": BLOCK}, TEXT, params(),
                             replays)


def test_dspark_varlen_graphs_match_eager_float32(replays):
    spec = {"method": "dspark", "num_speculative_tokens": BLOCK, "varlen": True,
            "sps_table": ((8, 100.0), (16, 99.0), (24, 30.0), (64, 5.0))}
    check_graphs_match_eager(DEFAULT_MODEL, spec, TEXT, greedy(), replays)


@pytest.fixture(scope="module")
def v4_dspark_dir(tmp_path_factory) -> Path:
    """The tiny V4 DSpark checkpoint with a drafter that knows the target's greedy bigrams
    (derived on the CPU), so verification accepts drafts."""
    return write_bigram_checkpoint_for(tmp_path_factory.mktemp("v4dspark"), V4_PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("params,invariant", [(greedy, False), (seeded, True)], ids=["greedy", "seeded-invariant"])
def test_v4_dspark_graphs_match_eager_float32(v4_dspark_dir, params, invariant, replays):
    """Seeded requests are compared in the batch-invariant mode, where no kernel config depends
    on the row count. In the normal mode graphs and eager may round differently: the checkpoint
    keeps its FP8 projections as shipped, the FP8 GEMM picks its tiles and K split by the row
    count (the drafter's graph rows are padded to a bucket), and an activation near an e4m3
    boundary turns a last-bit difference into ~1e-2 in a logprob, enough to move a seeded
    draw. On an H100 the target's graphs with an eager drafter matched eager bitwise, and with
    the drafter's graphs too logprobs moved by up to 1.5e-2 and one seeded request's tokens
    changed (scripts/probes/v4_dspark_seeded_graphs.py); this test in the mode tells that
    rounding from a fault."""
    check_graphs_match_eager(str(v4_dspark_dir), {"method": "dspark", "num_speculative_tokens": V4_BLOCK},
                             V4_PROMPTS, params(), replays, batch_invariant=invariant)


def test_mtp_graphs_match_eager_float32(v3_repeat_dir, replays):
    vocab = json.loads((Path(v3_repeat_dir) / "config.json").read_text())["vocab_size"]
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j + 3) % vocab for j in range(n)]}
               for i, n in enumerate([11, 29, 5, 40, 17])]
    check_graphs_match_eager(str(v3_repeat_dir), {"method": "mtp", "num_speculative_tokens": 3}, prompts,
                             greedy(), replays)


def test_dspark_without_drafter_graphs_runs_eagerly(replays):
    """``cuda_graphs=False``: plain decode graphs only; the drafter's steps run eagerly."""
    llm = make_llm(DEFAULT_MODEL, {"method": "dspark", "num_speculative_tokens": BLOCK, "cuda_graphs": False},
                   cuda_graph_sizes=SIZES)
    runner = llm.engine.runner
    assert runner.decode_graphs is not None and runner.draft_graphs is None
    tokens(llm, TEXT, greedy())
    assert runner.drafter_graph_steps == 0 and runner.verify_graph_steps == 0
