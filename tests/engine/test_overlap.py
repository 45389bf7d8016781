"""Overlapped ("async") scheduling end to end on the CPU: the same requests give the
same outputs with ``async_scheduling`` on and off (tokens, logprobs, finish and stop
reasons, text), through EOS, stop strings and tokens, max_tokens, n > 1, seeded
sampling, penalties, prompt logprobs, a structured request, preemption and an abort;
every block is back in the pool afterwards; and overlap really happens."""

from __future__ import annotations

import re

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.sampling_params import StructuredOutputsParams

from .conftest import make_checkpoint

PROMPTS = [
    "The list type is",
    "Return a new dictionary with keys from iterable and values set to value.",
    "x",
    "This module provides access to some objects used or maintained by the interpreter " * 2,
    "def fib(n):",
]


def snapshot(outs) -> list:
    """Everything a user sees of each request's final output, logprobs apart."""
    return [(o.request_id, o.error, o.prompt_token_ids,
             [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs])
            for o in outs]


def logprob_values(outs) -> tuple[list, list[float]]:
    """The logprob entries' keys and ranks (compared exactly) and values (compared to
    1e-5: the CPU matmuls round differently for other batch compositions, and the two
    modes batch differently, e.g. an overlapped step still carries a sequence that ended)."""
    keys, values = [], []
    for o in outs:
        entries = [e for e in (o.prompt_logprobs or []) if e is not None]
        for c in o.outputs:
            entries += c.logprobs or []
            if c.cumulative_logprob is not None:
                values.append(c.cumulative_logprob)
        for e in entries:
            keys.append(sorted((t, lp.rank) for t, lp in e.items()))
            values.extend(lp.logprob for _, lp in sorted(e.items()))
    return keys, values


def assert_same(a, b) -> None:
    assert snapshot(a) == snapshot(b)
    keys_a, values_a = logprob_values(a)
    keys_b, values_b = logprob_values(b)
    assert keys_a == keys_b
    assert values_a == pytest.approx(values_b, abs=1e-5)


def drive(llm: LLM, prompts, params, abort_after: dict[int, int] | None = None) -> list:
    """Add every request, step to the end (aborting request i after abort_after[i] steps);
    returns the final outputs in request order."""
    engine = llm.engine
    ids = [engine.add_request(p, sp, request_id=f"req{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    finals, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        for i, after in (abort_after or {}).items():
            if steps == after:
                engine.abort(ids[i])
    assert set(finals) == set(ids)
    return [finals[i] for i in ids]


def pool_is_full(llm: LLM) -> bool:
    kv = llm.engine.kv
    return kv.num_free_blocks == kv.pool.num_blocks - 1


def both(**kwargs) -> tuple[LLM, LLM]:
    return LLM(async_scheduling=True, **kwargs), LLM(async_scheduling=False, **kwargs)


def mixed_params(eos: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0}, min_tokens=3),  # EOS at 4
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.8, min_p=0.05, seed=3, max_tokens=14, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def tiny_pair() -> tuple[LLM, LLM]:
    return both(device="cpu", max_num_batched_tokens=64)


def test_mixed_batch_identical(tiny_pair):
    over, sync = tiny_pair
    params = mixed_params(min(over.tokenizer.eos_token_ids))
    a = drive(over, PROMPTS, params)
    b = drive(sync, PROMPTS, params)
    assert_same(a, b)
    assert a[2].outputs[0].token_ids[-1] in over.tokenizer.eos_token_ids and len(a[2].outputs[0].token_ids) == 4
    assert over.engine.stats.overlapped_steps > 0 and sync.engine.stats.overlapped_steps == 0
    assert pool_is_full(over) and pool_is_full(sync)


def test_stop_strings_and_tokens_identical(tiny_pair):
    over, sync = tiny_pair
    base = sync.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    stop_str, stop_tok = base.text[5:9], base.token_ids[6]
    params = [SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_str], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_str], include_stop_str_in_output=True,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[stop_tok], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)]
    prompts = [PROMPTS[1]] * 3 + [PROMPTS[0]]
    a, b = drive(over, prompts, params), drive(sync, prompts, params)
    assert_same(a, b)
    assert a[0].outputs[0].text == base.text[:base.text.index(stop_str)]
    assert a[2].outputs[0].stop_reason == stop_tok
    assert pool_is_full(over)


REGEX = r"[a-z]{2,6}-[0-9]{1,3}"
FALLBACKS = {
    "structured outputs": SamplingParams(temperature=0.0, max_tokens=20,
                                         structured_outputs=StructuredOutputsParams(regex=REGEX)),
    # Two tokens boosted far above the rest: which one comes next depends on how often each
    # came before, the last one included.
    "penalties": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, frequency_penalty=2.0,
                                repetition_penalty=1.1, logit_bias={300: 30.0, 301: 30.0}),
    "prompt logprobs": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
    "n > 1 fork": SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=7, ignore_eos=True, logprobs=2),
}


@pytest.mark.parametrize("reason", list(FALLBACKS))
def test_fallback_requests_identical(tiny_pair, reason):
    """A request that needs its tokens on the host before the next step is planned makes
    synchronous steps; mixed with plain requests the outputs stay the same."""
    over, sync = tiny_pair
    plain = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    params = [plain, FALLBACKS[reason], plain]
    prompts = PROMPTS[:3]
    before = over.engine.stats.sync_steps
    a, b = drive(over, prompts, params), drive(sync, prompts, params)
    assert_same(a, b)
    assert over.engine.stats.sync_steps > before
    if reason == "structured outputs":
        assert re.fullmatch(REGEX, a[1].outputs[0].text)
    if reason == "penalties":
        assert set(a[1].outputs[0].token_ids) == {300, 301}
    assert pool_is_full(over)


def test_abort_mid_run(tiny_pair):
    over, sync = tiny_pair
    # Request 0 is aborted after 4 steps, long before its 24 tokens.
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)]
    full = sync.generate(PROMPTS[3], params[0], use_tqdm=False)[0].outputs[0].token_ids
    for llm in (over, sync):
        a = drive(llm, [PROMPTS[3], PROMPTS[0]], params, abort_after={0: 4})
        assert a[0].outputs[0].finish_reason == "abort"
        assert a[0].outputs[0].token_ids == full[:len(a[0].outputs[0].token_ids)]
        assert a[1].outputs[0].finish_reason == "length" and len(a[1].outputs[0].token_ids) == 12
        assert pool_is_full(llm) and not llm.engine.has_unfinished()


def test_preemption_identical():
    over, sync = both(device="cpu", enable_prefix_caching=False, num_kv_blocks=24, block_size=4,
                      max_num_batched_tokens=64)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)] * 4 + [
        SamplingParams(temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)]
    a, b = drive(over, PROMPTS, params), drive(sync, PROMPTS, params)
    assert over.engine.scheduler.num_preemptions > 0 and sync.engine.scheduler.num_preemptions > 0
    assert_same(a, b)
    assert pool_is_full(over) and pool_is_full(sync)


def test_llama_identical(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM")
    over, sync = both(model=str(path), device="cpu", max_num_batched_tokens=32, block_size=4)
    params = mixed_params(min(over.tokenizer.eos_token_ids))
    a, b = drive(over, PROMPTS, params), drive(sync, PROMPTS, params)
    assert_same(a, b)
    assert over.engine.stats.overlapped_steps > 0
    assert pool_is_full(over) and pool_is_full(sync)


def test_stats_and_switch():
    from deepinfer.entrypoints.cli import build_parser, engine_kwargs

    assert engine_kwargs(build_parser().parse_args(["generate", "--prompt", "x"]))["async_scheduling"] is True
    off = build_parser().parse_args(["generate", "--prompt", "x", "--no-async-scheduling"])
    assert engine_kwargs(off)["async_scheduling"] is False
    llm = LLM(device="cpu", async_scheduling=False)
    assert not llm.engine.config.scheduler.async_scheduling
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=3), use_tqdm=False)
    s = llm.engine.stats
    assert s.steps >= 3 and s.overlapped_steps == 0
    assert s.gpu_idle_ms_per_step is None   # measured on CUDA only
