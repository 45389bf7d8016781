"""Overlapped scheduling with a model drafter (DSpark on the embedded default model, MTP on a
tiny DeepSeek-V3): the next speculative step is planned before the one in flight lands, and
the outputs are those of the synchronous path (tokens, finish and stop reasons, text;
logprobs to 1e-6) for greedy and seeded sampled requests, through requests that end at
different steps, max_tokens reached inside a step's drafts, a stop token or string inside
accepted drafts and an abort; every block is back in the pool afterwards; the speculative
steps really overlap. What still needs the host first (varlen verification, an n-gram
drafter) is named as the plan's sync reason."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams

from .test_mtp_drafter import MTP, prompts, v3_mtp_dir, v3_repeat_dir  # noqa: F401 (fixtures)
from .test_overlap import drive, logprob_values, pool_is_full, snapshot

DSPARK = {"method": "dspark", "num_speculative_tokens": 3}
PROMPTS = [
    "The list type is",
    "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n",
    "def fib(n):",
    "This module provides access to some objects used or maintained by the interpreter " * 2,
]


def assert_same(a, b) -> None:
    assert snapshot(a) == snapshot(b)
    keys_a, values_a = logprob_values(a)
    keys_b, values_b = logprob_values(b)
    assert keys_a == keys_b
    assert values_a == values_b


def spec_steps_overlapped(llm: LLM) -> float:
    stats = llm.engine.stats
    return stats.overlapped_steps / stats.steps


@pytest.fixture(scope="module")
def dspark() -> tuple[LLM, LLM]:
    """(overlapped, synchronous) engines with the embedded model's DSpark drafter."""
    return tuple(LLM(device="cpu", speculative_config=DSPARK, async_scheduling=a, max_num_batched_tokens=64,
                     batch_invariant=True)
                 for a in (True, False))


def run_both(pair: tuple[LLM, LLM], prompts, params, abort_after=None) -> tuple[list, list]:
    outs = []
    for llm in pair:
        llm.engine.reset_stats()
        outs.append(drive(llm, prompts, params, abort_after))
        assert pool_is_full(llm)
    return outs[0], outs[1]


def test_dspark_greedy_and_seeded_equal_the_synchronous_path(dspark):
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
        # max_tokens 7 and 13: reached inside a step's drafts, at different steps.
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=7, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=18, ignore_eos=True, logprobs=1),
    ]
    fast, slow = run_both(dspark, PROMPTS, params)
    assert_same(fast, slow)
    assert [len(o.outputs[0].token_ids) for o in fast] == [24, 7, 13, 18]
    assert dspark[1].engine.stats.overlapped_steps == 0
    # Every step but the first of each run and those after a sequence near its length limit.
    assert spec_steps_overlapped(dspark[0]) > 0.6
    assert dspark[0].engine.scheduler.spec_stats.num_draft_tokens > 0


def test_dspark_stop_token_and_string_inside_accepted_drafts(dspark):
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    reference = drive(dspark[1], PROMPTS[:2], [greedy, greedy])
    stop_token = reference[0].outputs[0].token_ids[9]
    text = reference[1].outputs[0].text
    stop_str = text[len(text) // 2:len(text) // 2 + 3]
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token]),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop_str]),
              SamplingParams(temperature=0.0, max_tokens=30)]      # ends on EOS
    fast, slow = run_both(dspark, [*PROMPTS[:2], PROMPTS[0]], params)
    assert_same(fast, slow)
    assert fast[0].outputs[0].stop_reason == stop_token
    assert fast[1].outputs[0].stop_reason == stop_str
    assert fast[2].outputs[0].finish_reason == "stop" and len(fast[2].outputs[0].token_ids) < 30
    assert spec_steps_overlapped(dspark[0]) > 0.5


def test_dspark_abort_and_unseeded_sampling_leave_no_blocks(dspark):
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True)]
    fast, slow = run_both(dspark, PROMPTS[:3], params, abort_after={1: 4})
    # Unseeded draws depend on the batches (an overlapped step still carries a sequence
    # that ended): only the lengths and the aborted request's greedy prefix compare.
    assert [len(o.outputs[0].token_ids) for o in fast] == [20, len(fast[1].outputs[0].token_ids), 16]
    assert fast[1].outputs[0].finish_reason == "abort"
    n = min(len(fast[1].outputs[0].token_ids), len(slow[1].outputs[0].token_ids))
    assert 0 < n < 40
    assert fast[1].outputs[0].token_ids[:n] == slow[1].outputs[0].token_ids[:n]
    assert dspark[0].engine.stats.overlapped_steps > 0


def test_mtp_greedy_and_seeded_equal_the_synchronous_path(v3_repeat_dir):  # noqa: F811
    # The repeat drafter's drafts are accepted in runs and rejected at their ends: steps
    # commit varying numbers of tokens, so the planned-ahead steps start at varying offsets.
    pair = tuple(LLM(model=str(v3_repeat_dir), device="cpu", speculative_config=MTP, async_scheduling=a,
                     max_num_batched_tokens=16, block_size=4, batch_invariant=True) for a in (True, False))
    ps = prompts(4)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, seed=5, max_tokens=11, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)]
    fast, slow = run_both(pair, ps, params)
    assert_same(fast, slow)
    stats = pair[0].engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert pair[0].engine.stats.overlapped_steps > 0.5 * pair[0].engine.stats.steps


def test_mtp_max_model_len_reached_inside_drafts(v3_repeat_dir):  # noqa: F811
    # No max_tokens: every sequence runs to max_model_len, which the tokens in flight may reach.
    pair = tuple(LLM(model=str(v3_repeat_dir), device="cpu", speculative_config=MTP, async_scheduling=a,
                     max_model_len=37, batch_invariant=True) for a in (True, False))
    params = [SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
              SamplingParams(temperature=0.5, seed=1, max_tokens=None, ignore_eos=True)]
    fast, slow = run_both(pair, prompts(2), params)
    assert_same(fast, slow)
    assert [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in fast] == [37, 37]
    assert all(o.outputs[0].finish_reason == "length" for o in fast)
    assert pair[0].engine.stats.overlapped_steps > 0


def test_varlen_and_host_drafts_stay_synchronous(v3_mtp_dir, monkeypatch):  # noqa: F811
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ngram = LLM(model=str(v3_mtp_dir), device="cpu", speculative_config={"method": "ngram",
                                                                         "num_speculative_tokens": 3})
    engine = ngram.engine
    assert engine.scheduler._speculative_sync_reason() == "speculative decoding: drafts proposed on the host"
    drive(ngram, [[1, 2, 3, 1, 2, 3, 1, 2]], [greedy])
    assert engine.stats.overlapped_steps == 0
    assert engine.stats.sync_steps > 0
    assert engine.scheduler.spec_stats.num_draft_tokens > 0
    # Varlen verification (DSpark's confidences pick how many drafts each step verifies).
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    varlen = LLM(device="cpu", speculative_config=DSPARK)
    plain = LLM(device="cpu", async_scheduling=False)
    assert_same(drive(varlen, PROMPTS[:2], [greedy, greedy]), drive(plain, PROMPTS[:2], [greedy, greedy]))
    assert varlen.engine.stats.overlapped_steps == 0
    assert varlen.engine.stats.sync_steps > 0
    assert pool_is_full(varlen)
