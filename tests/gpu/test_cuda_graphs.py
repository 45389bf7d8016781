"""Decode CUDA graphs on the GPU (run on the GPU machine: ``pytest -m gpu tests/gpu/test_cuda_graphs.py``).

Greedy tokens with graphs equal those of the eager engine (``enforce_eager=True``) in
float32, through mixed prompt lengths (one crossing many blocks), batch sizes between
buckets, batches larger than the largest bucket, sequences finishing mid-run, prefix-cache
hits and sliding-window groups; and the graphs really replay. The float32 reference runs
on one stream with plain launches, the graphs with DeepSeek-V4's side stream and PDL. In
bf16, where the eager and graph paths may round differently, their first differing token
is in each other's top 5.

The DeepSeek cases (``v4_tiny``: tests/data/tiny-v4-model, ``v4_random``, ``v3``) cover the sparse/compressed V4
attention and V3's absorbed MLA decode, each with Triton routing and experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams

from .. import TINY_V4_MODEL
from ..engine.conftest import make_checkpoint
from ..engine.test_deepseek_engine import v3_dir, v4_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8]
# Per prompt: its length and its max_tokens. The batch shrinks 5 -> 4 -> 3 -> 2 -> 1 as
# sequences finish, so it pads 5 -> 8 and 3 -> 4.
PROMPT_LENS = [300, 9, 40, 17, 3]
MAX_TOKENS = [24, 6, 17, 11, 30]


@pytest.fixture(scope="module",
                params=["llama", "qwen3_hybrid", "mistral", "v4_tiny", "v4_random", "v3"])
def checkpoint(request, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return make_checkpoint(tmp, "LlamaForCausalLM")
    if request.param == "qwen3_hybrid":
        return make_checkpoint(tmp, "Qwen3ForCausalLM", num_hidden_layers=3, use_sliding_window=True,
                               max_window_layers=1, sliding_window=8, head_dim=16)
    if request.param == "mistral":
        return make_checkpoint(tmp, "MistralForCausalLM", sliding_window=8)
    if request.param == "v4_tiny":
        return Path(TINY_V4_MODEL)
    if request.param == "v3":
        return request.getfixturevalue("v3_dir")
    return request.getfixturevalue("v4_dir")


def prompts_for(path: Path) -> list[list[int]]:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def greedy(logprobs: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
            for n in MAX_TOKENS]


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """Counts CUDAGraph.replay calls."""
    calls: list[int] = []
    real = torch.cuda.CUDAGraph.replay

    def counting(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting)
    return calls


def make_llm(path: Path, dtype: str, **kwargs) -> LLM:
    return LLM(model=str(path), device="cuda", dtype=dtype, max_num_seqs=8, max_num_batched_tokens=128,
               block_size=4, num_kv_blocks=600, **kwargs)


def test_graphs_match_eager_float32(checkpoint, replays, monkeypatch):
    prompts = prompts_for(checkpoint)
    # The reference: eager, one stream, plain launches (no side stream, no PDL).
    monkeypatch.setenv("DEEPINFER_SIDE_STREAM", "0")
    monkeypatch.setenv("DEEPINFER_PDL", "0")
    eager = make_llm(checkpoint, "float32", enforce_eager=True)
    assert eager.engine.runner.decode_graphs is None
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy(), use_tqdm=False)]
    del eager
    torch.cuda.empty_cache()
    monkeypatch.delenv("DEEPINFER_SIDE_STREAM")
    monkeypatch.delenv("DEEPINFER_PDL")

    graphs = make_llm(checkpoint, "float32", cuda_graph_sizes=SIZES)
    captured = graphs.engine.runner.decode_graphs
    assert captured is not None and sorted(captured.graphs) == SIZES, "graphs were captured"
    for _ in range(2):  # the second pass hits the prefix cache
        replays.clear()
        got = [o.outputs[0].token_ids for o in graphs.generate(prompts, greedy(), use_tqdm=False)]
        assert got == expected
        # Once the prompts are in (a few steps), every step is a decode of 1..5 sequences
        # and replays.
        assert len(replays) >= max(MAX_TOKENS) // 2
    kv = graphs.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


def test_batches_beyond_the_largest_bucket_run_eagerly(checkpoint, replays):
    prompts = prompts_for(checkpoint)
    eager = make_llm(checkpoint, "float32", enforce_eager=True)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, greedy(), use_tqdm=False)]
    del eager
    torch.cuda.empty_cache()
    small = make_llm(checkpoint, "float32", cuda_graph_sizes=[1, 2])
    got = [o.outputs[0].token_ids for o in small.generate(prompts, greedy(), use_tqdm=False)]
    assert got == expected
    # Decodes of 5..3 sequences ran eagerly; those of 2 and 1 replayed.
    decode_steps = max(MAX_TOKENS) - 1
    assert 0 < len(replays) < decode_steps


def test_graphs_match_eager_bfloat16(checkpoint):
    prompts = prompts_for(checkpoint)
    eager = make_llm(checkpoint, "bfloat16", enforce_eager=True)
    ref = eager.generate(prompts, greedy(logprobs=5), use_tqdm=False)
    del eager
    torch.cuda.empty_cache()
    graphs = make_llm(checkpoint, "bfloat16")
    assert graphs.engine.runner.decode_graphs is not None, "graphs were captured"
    outs = graphs.generate(prompts, greedy(logprobs=5), use_tqdm=False)
    for out, r in zip(outs, ref):
        a, b = out.outputs[0], r.outputs[0]
        first = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if first is not None:  # a bf16 near-tie: each side's token is in the other's top 5
            assert b.token_ids[first] in a.logprobs[first]
            assert a.token_ids[first] in b.logprobs[first]
