"""The engine on a CUDA device (run on the GPU machine: ``pytest -m gpu tests/gpu``).

Per model family: the engine on CUDA in float32 gives HF transformers' greedy
tokens (CPU, float32), through batching, chunked prefill, prefix caching and
preemption; in bf16 its prompt logprobs stay within bf16 tolerance of HF's
float32 log-softmax, and where its greedy tokens first differ from HF's, HF's
token is in its top 5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams

from ..engine.conftest import hf_greedy, make_checkpoint
from ..engine.test_deepseek_engine import v3_dir, v4_dir  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu

NEW = 24
CUDA = "cuda"


@pytest.fixture(scope="module", params=["llama", "qwen3_hybrid", "qwen3_moe", "mistral", "v4", "v3"])
def checkpoint(request, tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        return make_checkpoint(tmp, "LlamaForCausalLM")
    if request.param == "qwen3_hybrid":
        return make_checkpoint(tmp, "Qwen3ForCausalLM", num_hidden_layers=3, use_sliding_window=True,
                               max_window_layers=1, sliding_window=8, head_dim=16)
    if request.param == "qwen3_moe":
        return make_checkpoint(tmp, "Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, norm_topk_prob=True, head_dim=16)
    if request.param == "mistral":
        return make_checkpoint(tmp, "MistralForCausalLM", sliding_window=8)
    return request.getfixturevalue(f"{request.param}_dir")


def prompts_for(path: Path) -> list[list[int]]:
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (300, 9, 40)]


def test_engine_on_cuda(checkpoint):
    prompts = prompts_for(checkpoint)
    hf_tokens, hf_logprobs = hf_greedy(checkpoint, prompts, NEW, with_logprobs=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

    fp32 = LLM(model=str(checkpoint), device=CUDA, dtype="float32", max_num_batched_tokens=64,
               block_size=4, num_kv_blocks=400)
    for _ in range(2):  # the second pass hits the prefix cache
        got = [o.outputs[0].token_ids for o in fp32.generate(prompts, greedy, use_tqdm=False)]
        assert got == hf_tokens
    kv = fp32.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    del fp32

    bf16 = LLM(model=str(checkpoint), device=CUDA, dtype="bfloat16", gpu_memory_utilization=0.3)
    plp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, prompt_logprobs=1, logprobs=5)
    outs = bf16.generate(prompts, plp, use_tqdm=False)
    for out, ref, ref_tokens in zip(outs, hf_logprobs, hf_tokens):
        ids = out.prompt_token_ids
        ours = torch.tensor([out.prompt_logprobs[i + 1][ids[i + 1]].logprob for i in range(len(ids) - 1)])
        theirs = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert (ours - theirs).abs().max().item() < 0.15 * max(1.0, theirs.abs().max().item())
        got = out.outputs[0].token_ids
        first_diff = next((i for i, (a, b) in enumerate(zip(got, ref_tokens)) if a != b), None)
        if first_diff is not None:  # a bf16 near-tie: HF's choice must be among our top 5
            assert ref_tokens[first_diff] in out.outputs[0].logprobs[first_diff]
