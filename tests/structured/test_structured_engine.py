"""Structured outputs end to end on the embedded model (CPU): every output that the
grammar finished is checked by an independent judge (``re.fullmatch``, membership,
a recursive-descent parser, ``json.loads`` + ``jsonschema``), greedy and sampled,
with n > 1, under preemption and with prefix-cache hits."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.sampling_params import StructuredOutputsParams

PROMPTS = ["The answer is", "Return a new dictionary with keys from iterable.", "x = ",
           "This module provides access to some objects used or maintained by the interpreter " * 2]

REGEX = r"[a-z]{2,6}-[0-9]{1,3}(\.[0-9]{2})?"
CHOICES = ["yes", "no", "maybe so", 'say "hi"\n']
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] [0-9]? | "(" expr ")"
"""
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "kind": {"enum": ["cat", "dog", None]},
        "score": {"anyOf": [{"type": "number", "minimum": -1, "maximum": 1}, {"type": "null"}]},
    },
    "required": ["name", "age", "kind"],
}
TEMPERATURES = [0.0, 1.0]


def structured(so: StructuredOutputsParams, temperature: float, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", 64)
    return SamplingParams(temperature=temperature, seed=7, structured_outputs=so, **kw)


def parses_arithmetic(text: str) -> bool:
    """A recursive-descent recogniser for ARITHMETIC."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def expr() -> bool:
        nonlocal pos
        if not term():
            return False
        while peek() in ("+", "-"):
            pos += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal pos
        if not factor():
            return False
        while peek() in ("*", "/"):
            pos += 1
            if not factor():
                return False
        return True

    def factor() -> bool:
        nonlocal pos
        if peek().isdigit():
            pos += 1
            if peek().isdigit():
                pos += 1
            return True
        if peek() == "(":
            pos += 1
            if not expr() or peek() != ")":
                return False
            pos += 1
            return True
        return False

    return expr() and pos == len(text)


def test_parser_is_a_real_judge():
    assert parses_arithmetic("12+(3*4)-5/67") and parses_arithmetic("(1)")
    assert not parses_arithmetic("123") and not parses_arithmetic("1+") and not parses_arithmetic("(1")


def finished(outs) -> list:
    return [c for o in outs for c in o.outputs if c.finish_reason == "stop"]


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_regex_outputs_fullmatch(llm, temperature):
    outs = llm.generate(PROMPTS, structured(StructuredOutputsParams(regex=REGEX), temperature), use_tqdm=False)
    assert len(finished(outs)) == len(PROMPTS)                    # the regex is bounded: all must finish
    for c in finished(outs):
        assert re.fullmatch(REGEX, c.text), c.text
        assert c.token_ids[-1] in llm.engine.tokenizer.eos_token_ids


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_choice_outputs_are_choices(llm, temperature):
    outs = llm.generate(PROMPTS, structured(StructuredOutputsParams(choice=CHOICES), temperature),
                        use_tqdm=False)
    assert len(finished(outs)) == len(PROMPTS)
    assert all(c.text in CHOICES for c in finished(outs))


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_ebnf_outputs_parse(llm, temperature):
    outs = llm.generate(PROMPTS, structured(StructuredOutputsParams(grammar=ARITHMETIC), temperature),
                        use_tqdm=False)
    done = finished(outs)
    assert done
    for c in done:
        assert parses_arithmetic(c.text), c.text
    for o in outs:                               # a cut-off output is still a prefix the grammar allows
        assert re.fullmatch(r"[0-9+\-*/()]*", o.outputs[0].text)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_json_outputs_validate(llm, temperature):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = llm.generate(PROMPTS, structured(so, temperature, max_tokens=96), use_tqdm=False)
    done = finished(outs)
    assert len(done) >= len(PROMPTS) - 1
    for c in done:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_json_object(llm):
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    outs = llm.generate(PROMPTS, structured(so, 1.0, max_tokens=96), use_tqdm=False)
    assert finished(outs)
    for c in finished(outs):
        assert isinstance(json.loads(c.text), dict)


def test_n_siblings_each_follow_the_grammar(llm):
    so = StructuredOutputsParams(regex=REGEX)
    many = llm.generate(PROMPTS[:2], structured(so, 1.0, n=4), use_tqdm=False)
    one = llm.generate(PROMPTS[:2], structured(so, 1.0), use_tqdm=False)
    for out_many, out_one in zip(many, one):
        assert len(out_many.outputs) == 4
        assert all(c.finish_reason == "stop" and re.fullmatch(REGEX, c.text) for c in out_many.outputs)
        # Sample 0 draws from the same seeded stream as an n=1 request: the siblings'
        # matchers did not disturb it.
        assert out_many.outputs[0].token_ids == out_one.outputs[0].token_ids


def test_mixed_batch_leaves_unconstrained_requests_alone(llm):
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain, use_tqdm=False)
    params = [plain, structured(StructuredOutputsParams(regex=REGEX), 0.0)] * 2
    mixed = llm.generate(PROMPTS, params, use_tqdm=False)
    for i in (0, 2):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)


def test_logprobs_are_the_raw_distribution(llm):
    prompt = PROMPTS[0]
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)
    constrained = llm.generate(prompt, structured(StructuredOutputsParams(choice=["maybe so"]), 0.0, logprobs=5),
                               use_tqdm=False)
    first_plain = plain[0].outputs[0].logprobs[0]
    first = constrained[0].outputs[0].logprobs[0]
    top = {t: lp.logprob for t, lp in first_plain.items() if lp.rank <= 5}
    assert {t: lp.logprob for t, lp in first.items() if lp.rank <= 5} == pytest.approx(top, abs=1e-5)
    assert constrained[0].outputs[0].text == "maybe so"


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_grammar_end_finishes_despite_ignore_eos_and_min_tokens(llm, ignore_eos):
    params = structured(StructuredOutputsParams(choice=["maybe so"]), 0.0, ignore_eos=ignore_eos,
                        min_tokens=20, max_tokens=40)
    out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == "maybe so"
    assert len(out.token_ids) < 20


def test_bad_spec_raises_at_add_request_and_leaves_no_state(llm):
    engine = llm.engine
    for so in (StructuredOutputsParams(regex="a("), StructuredOutputsParams(json={"type": "integer", "not": {}}),
               StructuredOutputsParams(grammar="root ::= missing")):
        with pytest.raises(ValueError, match=r"^structured_outputs\.(regex|json|grammar)"):
            engine.add_request("hi", SamplingParams(structured_outputs=so))
    assert not engine.requests and not engine.scheduler.has_unfinished


def test_compilation_time_limit_through_the_engine(llm):
    from .test_backend import large_schema

    engine = llm.engine
    llm.generate("x", structured(StructuredOutputsParams(regex="a"), 0.0), use_tqdm=False)   # backend made
    limit = engine.structured.compile_timeout_s
    engine.structured.compile_timeout_s = 0.01
    try:
        with pytest.raises(ValueError, match=r"grammar compilation exceeded 0.01 s"):
            engine.add_request("hi", SamplingParams(structured_outputs={"json": large_schema(41)}))
    finally:
        engine.structured.compile_timeout_s = limit
    assert not engine.requests


def test_compiled_grammars_are_cached_across_requests(llm):
    engine = llm.engine
    so = StructuredOutputsParams(choice=["x", "y"])
    llm.generate("a", structured(so, 0.0), use_tqdm=False)
    grammar = engine.structured.compile(so)
    llm.generate("b", structured(StructuredOutputsParams(choice=["x", "y"]), 0.0), use_tqdm=False)
    assert engine.structured.compile(StructuredOutputsParams(choice=["x", "y"])) is grammar


def mixed_params(temperature: float) -> list[SamplingParams]:
    one = [structured(StructuredOutputsParams(regex=REGEX), temperature),
           structured(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), temperature,
                      max_tokens=48),
           structured(StructuredOutputsParams(grammar=ARITHMETIC), temperature, max_tokens=32),
           structured(StructuredOutputsParams(choice=CHOICES), temperature)]
    return one + one[::-1]


BATCH = PROMPTS * 2


def token_ids(outs) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.fixture(scope="module", params=TEMPERATURES)
def reference(request, llm) -> tuple[float, list[list[int]]]:
    return request.param, token_ids(llm.generate(BATCH, mixed_params(request.param), use_tqdm=False))


def test_preemption_keeps_grammar_state(reference):
    # A resumed sequence recomputes its tokens; its matcher must not accept them again.
    temperature, expect = reference
    small = LLM(device="cpu", enable_prefix_caching=False, num_kv_blocks=24, block_size=4,
                max_num_batched_tokens=64)
    outs = small.generate(BATCH, mixed_params(temperature), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert token_ids(outs) == expect
    assert all(c.finish_reason in ("stop", "length") for o in outs for c in o.outputs)


def test_prefix_cache_hit_gives_the_same_outputs(reference):
    temperature, _ = reference
    # A hit is a whole number of every KV group's blocks: with block_size=1 the embedded
    # DeepSeek-V4's ratio-16 group has 64-token blocks, so the prompts are made longer.
    batch = [p * 6 for p in BATCH]
    expect = token_ids(LLM(device="cpu", enable_prefix_caching=False).generate(
        batch, mixed_params(temperature), use_tqdm=False))
    cached = LLM(device="cpu", max_num_batched_tokens=64, block_size=1)
    first = cached.generate(batch, mixed_params(temperature), use_tqdm=False)
    second = cached.generate(batch, mixed_params(temperature), use_tqdm=False)
    assert second[3].num_cached_tokens > 0
    assert token_ids(first) == token_ids(second) == expect


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_structured_outputs_on_cuda():
    gpu = LLM(device="cuda", max_num_batched_tokens=512)
    for temperature in TEMPERATURES:
        outs = gpu.generate(BATCH, mixed_params(temperature), use_tqdm=False)
        kinds = [p.structured_outputs for p in mixed_params(temperature)]
        for so, out in zip(kinds, outs):
            c = out.outputs[0]
            if c.finish_reason != "stop":
                continue
            if so.regex is not None:
                assert re.fullmatch(REGEX, c.text)
            elif so.json is not None:
                jsonschema.validate(json.loads(c.text), SCHEMA)
            elif so.grammar is not None:
                assert parses_arithmetic(c.text)
            else:
                assert c.text in CHOICES
