"""Prefix caching at the base block size on the DeepSeek models, through the whole engine.

A chat-like workload (one shared system prompt, then different questions) must hit the
cache at 16-token granularity although the models' compressed groups have blocks of 128
to 1,024 tokens, and a hit must give the tokens a miss gives (logprobs to float32
rounding: the hit changes how the prompt is chunked), through chunked prefill,
preemption and ``n`` > 1, with every block back in the pool at the end."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

from .. import TINY_V4_MODEL

MODELS = {"v4.1": None, "v4": TINY_V4_MODEL}
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)
SYSTEM_LEN = 200            # 12.5 blocks of 16: hits of 192 tokens end inside every larger block


def chat_prompts(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 1000, (SYSTEM_LEN,), generator=g).tolist()
    return [system + torch.randint(3, 1000, (8 + 9 * i,), generator=g).tolist() for i in range(n)]


def llm_for(name: str, **kw) -> LLM:
    model = MODELS[name]
    return LLM(device="cpu", **({"model": model} if model else {}), **kw)


def pool_is_full(llm: LLM) -> bool:
    kv = llm.engine.kv
    return kv.num_free_blocks == kv.pool.num_blocks - 1


def assert_same(got, want) -> None:
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for pos, (lg, lw) in enumerate(zip(g.outputs[0].logprobs, w.outputs[0].logprobs)):
            tok = g.outputs[0].token_ids[pos]
            assert abs(lg[tok].logprob - lw[tok].logprob) < 1e-4


@pytest.fixture(scope="module", params=list(MODELS))
def misses(request):
    """The reference: caching off, each prompt alone."""
    llm = llm_for(request.param, enable_prefix_caching=False)
    return request.param, [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in chat_prompts()]


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 48}])
def test_shared_system_prompt_hits_at_16_tokens(misses, settings):
    name, reference = misses
    llm = llm_for(name, **settings)
    assert llm.engine.kv.hit_step == 16
    assert max(g.tokens_per_block for g in llm.engine.kv.groups) > 16
    outs = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in chat_prompts()]
    assert [o.num_cached_tokens for o in outs] == [0, 192, 192]
    assert_same(outs, reference)
    assert pool_is_full(llm)


def test_hit_under_preemption_and_n(misses):
    name, reference = misses
    llm = llm_for(name, num_kv_blocks=40, block_size=16, max_num_batched_tokens=64)
    prompts = chat_prompts()
    llm.generate([prompts[0]], PARAMS, use_tqdm=False)
    outs = llm.generate(prompts[1:], PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens == 192 for o in outs)
    assert_same(outs, reference[1:])
    forked = llm.generate([prompts[2]], SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0]
    assert forked.num_cached_tokens >= 192
    assert [c.token_ids for c in forked.outputs] == [reference[2].outputs[0].token_ids] * 2
    assert pool_is_full(llm)


def test_prompt_logprobs_recompute_and_still_publish(misses):
    """A request asking for prompt logprobs computes its whole prompt (cached positions'
    logprobs are not kept), says so with ``num_cached_tokens`` 0, and its blocks serve
    the next request."""
    name, _ = misses
    llm = llm_for(name)
    prompts = chat_prompts()
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    first = llm.generate([prompts[0]], with_logprobs, use_tqdm=False)[0]
    again = llm.generate([prompts[0]], with_logprobs, use_tqdm=False)[0]
    assert first.num_cached_tokens == again.num_cached_tokens == 0
    assert len(again.prompt_logprobs) == len(prompts[0])
    for a, b in zip(first.prompt_logprobs[1:], again.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
    assert llm.generate([prompts[1]], PARAMS, use_tqdm=False)[0].num_cached_tokens == 192
