"""Greedy tokens through the whole engine equal HF transformers' greedy tokens,
for models whose caches differ: full attention, sliding window (prompts and
generations longer than the window) and a hybrid full + sliding model (two KV
groups). Each under batching, chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

from .conftest import hf_greedy, make_checkpoint

NEW_TOKENS = 32


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 19, 40)]


ENGINE_SETTINGS = {
    "batched": dict(max_num_batched_tokens=512),
    "chunked": dict(max_num_batched_tokens=16),
    "preempt": dict(num_kv_blocks=26, block_size=4, max_num_batched_tokens=64),
}


def check(path, settings, expect_preemption=True):
    import json
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(vocab)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    llm = LLM(model=str(path), device="cpu", **settings)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # Second pass hits the prefix cache (when enabled) and must not change anything.
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == expected
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    if "num_kv_blocks" in settings and expect_preemption:
        assert llm.engine.scheduler.num_preemptions > 0
    return llm


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
def test_sliding_window_model(sliding_model_dir, setting):
    # A sequence holds at most 3 blocks of 4 here and decodes free as many as they
    # take, so a tight pool only limits how many run at once: nothing gets preempted.
    settings = ENGINE_SETTINGS[setting]
    if setting == "preempt":
        settings = {**settings, "num_kv_blocks": 5}
    llm = check(sliding_model_dir, settings, expect_preemption=False)
    assert [g.kind for g in llm.engine.kv.groups] == ["sliding"]


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
def test_hybrid_model(hybrid_model_dir, setting):
    llm = check(hybrid_model_dir, ENGINE_SETTINGS[setting])
    assert sorted(g.kind for g in llm.engine.kv.groups) == ["full", "sliding"]


@pytest.mark.parametrize("arch,extra", [
    ("LlamaForCausalLM", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    ("Qwen3MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True, head_dim=16)),
])
def test_other_models(tmp_path, arch, extra):
    check(make_checkpoint(tmp_path, arch, **extra), ENGINE_SETTINGS["chunked"])
