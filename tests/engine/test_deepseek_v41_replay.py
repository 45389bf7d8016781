"""SWA bounded replay on DeepSeek-V4.1 (the tiny reference checkpoint: window 8, layers 5-7
after the last KV source): ``exact`` equals ``full`` through chunked prefill, prefix-cache
hits and preemption; ``compact`` changes outputs only for prompts longer than its keep
length; a keep length below the window is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from deepinfer import LLM, SamplingParams

DATA = Path(__file__).resolve().parent.parent / "data" / "v41_reference"
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    e = np.load(DATA / "expected.npz")
    ids, off = e["prompt_ids"], e["prompt_offsets"]
    return [ids[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]


def run(prompts, mode: str, keep: int = 140, **settings) -> tuple[list, LLM]:
    llm = LLM(model=str(DATA / "checkpoint"), device="cpu", dtype="float32", kv_cache_dtype="float32",
              max_num_batched_tokens=16, block_size=4, yoco_prefill_truncation_mode=mode,
              yoco_prefill_keep_tokens=keep, **settings)
    outs = []
    for _ in range(2):                                    # the second pass hits the prefix cache
        got = llm.generate(prompts, PARAMS, use_tqdm=False)
        outs.append([(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                                o.outputs[0].logprobs)])
                     for o in got])
    assert [t for t, _ in outs[0]] == [t for t, _ in outs[1]]
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    return outs[0], llm


@pytest.fixture(scope="module")
def full(prompts):
    return run(prompts, "full")[0]


def assert_same(got, want) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, want):
        assert tokens == ref_tokens
        np.testing.assert_allclose(logprobs, ref_logprobs, atol=1e-5)


def test_exact_equals_full(prompts, full):
    got, llm = run(prompts, "exact")
    # 3 late layers x window 8: the late layers skip all but the last 24 prompt tokens.
    assert llm.engine.model.replay_keep_tokens("exact", 140) == 24
    assert_same(got, full)


def test_exact_equals_full_when_preempted(prompts, full):
    got, llm = run(prompts, "exact", num_kv_blocks=24, max_num_seqs=8)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same(got, full)


def test_compact_truncates_only_long_prompts(prompts, full):
    got, _ = run(prompts, "compact", keep=10)
    long = [len(p) > 10 for p in prompts]
    # Prompts no longer than the keep length run every layer on every token.
    assert_same([g for g, is_long in zip(got, long) if not is_long],
                [f for f, is_long in zip(full, long) if not is_long])
    # Longer ones are approximated: the late layers' windows start empty at the replay start.
    assert any(g != f for g, f, is_long in zip(got, full, long) if is_long)


def test_keep_shorter_than_the_window_is_refused(prompts):
    with pytest.raises(ValueError, match="yoco_prefill_keep_tokens=7 is shorter than the sliding window"):
        run(prompts, "compact", keep=7)
