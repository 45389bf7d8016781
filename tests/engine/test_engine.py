"""End-to-end engine behaviour on the CPU: equalities between schedules, sampling
features, and failure isolation."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams

PROMPTS = [
    "The list type is",
    "Return a new dictionary with keys from iterable and values set to value.",
    "x",
    "This module provides access to some objects used or maintained by the interpreter " * 3,
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def pool_is_full(llm: LLM) -> bool:
    kv = llm.engine.kv
    return kv.num_free_blocks == kv.pool.num_blocks - 1


def test_generate_shapes_and_order(tiny_llm):
    outs = tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    for o in outs:
        assert o.finished and len(o.outputs) == 1
        c = o.outputs[0]
        assert len(c.token_ids) == 24 and c.finish_reason == "length"
        assert c.text == tiny_llm.tokenizer.decode(c.token_ids)
        assert o.prompt_token_ids == tiny_llm.tokenizer.encode(o.prompt)
    assert pool_is_full(tiny_llm)


def test_single_prompt_and_token_ids(tiny_llm):
    ids = tiny_llm.tokenizer.encode(PROMPTS[0])
    a = tiny_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    b = tiny_llm.generate([ids], GREEDY, use_tqdm=False)
    assert token_ids(a) == token_ids(b)
    assert b[0].prompt is None and b[0].prompt_token_ids == ids


def test_batched_equals_one_at_a_time(tiny_llm):
    batched = token_ids(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    alone = [token_ids(tiny_llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert batched == alone


@pytest.fixture(scope="module")
def reference_tokens(tiny_llm):
    llm = LLM(device="cpu", enable_prefix_caching=False, max_num_batched_tokens=4096)
    return token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


def test_chunked_prefill_equals_one_shot(reference_tokens):
    llm = LLM(device="cpu", enable_prefix_caching=False, max_num_batched_tokens=16)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference_tokens


def test_prefix_hit_equals_miss(reference_tokens):
    # Hits are multiples of the base block size (4 tokens here), whatever the compressed
    # and full groups' blocks span.
    llm = LLM(device="cpu", max_num_batched_tokens=64, block_size=4)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    second = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in first)
    assert second[3].num_cached_tokens > 0
    assert token_ids(first) == token_ids(second) == reference_tokens
    assert pool_is_full(llm)


def test_preemption_keeps_output(reference_tokens):
    llm = LLM(device="cpu", enable_prefix_caching=False, num_kv_blocks=28, block_size=4,
              max_num_batched_tokens=64)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert token_ids(outs) == reference_tokens
    assert pool_is_full(llm)


def test_n_greater_than_one(tiny_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = tiny_llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(seqs)) == 3 and all(len(s) == 12 for s in seqs)
    again = tiny_llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == seqs
    assert pool_is_full(tiny_llm)


def test_seeded_sampling_independent_of_batch(tiny_llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tiny_llm.generate([PROMPTS[0]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    noisy = SamplingParams(temperature=1.3, max_tokens=20, ignore_eos=True)
    outs = tiny_llm.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3]], [noisy, seeded, noisy], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    other_seed = tiny_llm.generate([PROMPTS[0]], SamplingParams(
        temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_strings_and_stop_tokens(tiny_llm):
    base = tiny_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    text = base.text
    assert len(text) > 10
    stop = text[5:9]  # a stop string that may span tokens
    out = tiny_llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    incl = tiny_llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                        include_stop_str_in_output=True, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert incl.text == text[:text.index(stop) + len(stop)]
    tok = base.token_ids[3]
    out = tiny_llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tok],
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    assert out.token_ids == base.token_ids[:base.token_ids.index(tok) + 1]
    assert pool_is_full(tiny_llm)


def test_min_tokens_and_eos(tiny_llm):
    eos = min(tiny_llm.tokenizer.eos_token_ids)
    bias = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0})
    out = tiny_llm.generate(PROMPTS[0], bias, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [eos]
    held = SamplingParams(temperature=0.0, max_tokens=10, logit_bias={eos: 100.0}, min_tokens=4)
    out = tiny_llm.generate(PROMPTS[0], held, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    ignore = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={eos: 100.0}, ignore_eos=True)
    out = tiny_llm.generate(PROMPTS[0], ignore, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] * 6 and out.finish_reason == "length"


def test_logprobs_and_prompt_logprobs(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    out = tiny_llm.generate(PROMPTS[1], params, use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    plp = out.prompt_logprobs
    assert len(plp) == len(out.prompt_token_ids) and plp[0] is None
    for tok, entry in zip(out.prompt_token_ids[1:], plp[1:]):
        assert tok in entry and len(entry) in (2, 3)
    # Same numbers from a full forward of the model.
    engine = tiny_llm.engine
    ids = torch.tensor(out.prompt_token_ids)
    from deepinfer.forward_context import ForwardContext
    with torch.inference_mode():
        logits = engine.model.compute_logits(engine.model(ids, ForwardContext.no_cache([len(ids)], ids.device)))
    ref = torch.log_softmax(logits, -1)
    for i, tok in enumerate(out.prompt_token_ids[1:]):
        assert plp[i + 1][tok].logprob == pytest.approx(ref[i, tok].item(), abs=1e-4)


def test_chat_uses_template(tiny_llm):
    msgs = [{"role": "user", "content": "What is a list?"}]
    out = tiny_llm.chat(msgs, GREEDY, use_tqdm=False)[0]
    rendered = tiny_llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert out.prompt_token_ids == tiny_llm.tokenizer.encode(rendered, add_special_tokens=False)


def test_abort_frees_blocks(tiny_llm):
    engine = tiny_llm.engine
    rid = engine.add_request(PROMPTS[3], SamplingParams(max_tokens=100, ignore_eos=True))
    other = engine.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert not pool_is_full(tiny_llm)
    engine.abort(rid)
    finals = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    assert finals[rid].outputs[0].finish_reason == "abort"
    assert finals[other].outputs[0].finish_reason == "length"
    assert pool_is_full(tiny_llm)


@pytest.mark.parametrize("bad", [
    dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-5), dict(max_tokens=0), dict(n=0),
    dict(min_p=1.5), dict(repetition_penalty=0.0), dict(logprobs=-2),
])
def test_bad_parameters_raise(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_bad_input_raises_and_engine_stays_up(tiny_llm):
    vocab = tiny_llm.engine.config.model.vocab_size
    with pytest.raises(ValueError, match="out of range"):
        tiny_llm.generate([[1, vocab + 5]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        tiny_llm.generate("hi", SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    assert len(tiny_llm.generate("hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24


def test_impossible_request_fails_alone():
    llm = LLM(device="cpu", max_model_len=64)
    long_prompt = "word " * 200
    outs = llm.generate([PROMPTS[0], long_prompt, PROMPTS[1]], GREEDY, use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and "max_model_len" in outs[1].error
    assert [len(o.outputs[0].token_ids) for o in (outs[0], outs[2])] == [24, 24]
    small = LLM(device="cpu", num_kv_blocks=4, block_size=4)
    outs = small.generate([PROMPTS[2], PROMPTS[3]], SamplingParams(max_tokens=4, ignore_eos=True),
                          use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and "blocks" in outs[1].error
    assert outs[0].outputs[0].finish_reason == "length"
    assert pool_is_full(small)


def test_parallel_flags_raise():
    with pytest.raises(NotImplementedError, match=r"dp=2 \(data_parallel_size\) without expert parallelism"):
        LLM(device="cpu", data_parallel_size=2)


def test_streamed_deltas_add_up_and_hold_back_stop_strings(tiny_llm):
    engine = tiny_llm.engine
    base = tiny_llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = base[6:10]
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                        ignore_eos=True))
    deltas, final = [], None
    while final is None:
        for out in engine.step():
            if out.request_id == rid:
                deltas.append(out.outputs[0].delta_text)
                assert stop not in "".join(deltas)
                if out.finished:
                    final = out
    assert "".join(deltas) == final.outputs[0].text == base[:base.index(stop)]


def test_cli_generate_streams(capsys):
    from deepinfer.entrypoints.cli import main

    assert main(["generate", "--device", "cpu", "--prompt", "The list type", "--max-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("The list type")


def test_final_only_outputs(tiny_llm):
    """FINAL_ONLY: step() reports a request once, when it finishes, with the same output a
    CUMULATIVE request gets; LLM.generate asks for it without changing the caller's params."""
    from deepinfer.sampling_params import RequestOutputKind

    engine = tiny_llm.engine
    final = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    reported: dict[str, list] = {}
    ids = {engine.add_request(p, final if i % 2 else GREEDY): i for i, p in enumerate(PROMPTS)}
    while engine.has_unfinished():
        for out in engine.step():
            reported.setdefault(out.request_id, []).append(out)
    for rid, i in ids.items():
        outs = reported[rid]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 24
        if i % 2:
            assert len(outs) == 1                        # only the finished output
        else:
            assert len(outs) > 1 and not outs[0].finished
    by_prompt = {PROMPTS[i]: reported[rid][-1].outputs[0] for rid, i in ids.items()}
    for out in tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False):
        assert out.outputs[0].token_ids == by_prompt[out.prompt].token_ids
        assert out.outputs[0].text == by_prompt[out.prompt].text
    assert GREEDY.output_kind is RequestOutputKind.CUMULATIVE
    assert pool_is_full(tiny_llm)


def test_close_releases_the_engine_memory():
    """close(): the KV cache, graphs and weights are dropped (another engine can take the memory)
    and the engine refuses new requests with a clear error; a second close is harmless."""
    import gc
    import weakref
    with LLM(device="cpu", max_model_len=64, kv_offload_gib=0.01) as llm:      # a host tier holds the cache too
        out = llm.generate(["The list type"], SamplingParams(max_tokens=4, temperature=0.0))
        assert len(out[0].outputs[0].token_ids) == 4
        runner = llm.engine.runner
        weight = weakref.ref(next(runner.model.parameters()))
        cache = weakref.ref(runner.kv_buffer)
    gc.collect()
    assert weight() is None and cache() is None
    assert runner.model is None and runner.kv_buffer is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["again"], SamplingParams(max_tokens=2))
    llm.close()
