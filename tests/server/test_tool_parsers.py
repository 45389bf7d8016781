"""DeepSeek tool-call and reasoning parsing without a server: hand-written DeepSeek-format
text (single and parallel calls, malformed blocks), streaming at every split point and at
the embedded tokenizer's token boundaries, the grammar that forces calls, the fallback
tool prompt."""

from __future__ import annotations

import json

import pytest

from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.entrypoints.openai.reasoning import (REASONING_PARSERS, ReasoningStreamSplitter,
                                                    get_reasoning_parser, split_reasoning)
from deepinfer.entrypoints.openai.tool_parsers import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END,
                                                       TOOL_CALL_FORMATS, TOOL_SEP, ToolCallDelta,
                                                       ToolCallStreamParser, get_tool_call_format,
                                                       parse_tool_calls)
from deepinfer.sampling_params import StructuredOutputsParams
from deepinfer.structured.xgrammar_backend import XGrammarBackend

V3 = TOOL_CALL_FORMATS["deepseek_v3"]
V31 = TOOL_CALL_FORMATS["deepseek_v31"]

# DeepSeek's own examples of the two formats, written out by hand (not by render_calls).
V3_TWO_CALLS = ('Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                '```json\n{"location": "Beijing"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
                '<｜tool▁sep｜>get_time\n```json\n{"zone": "UTC+8", "fmt": "24h"}\n```<｜tool▁call▁end｜>'
                '<｜tool▁calls▁end｜>')
V31_TWO_CALLS = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "杭州"}'
                 '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"zone": "UTC+8", "fmt": "24h"}'
                 '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
WELL_FORMED = [
    (V3, V3_TWO_CALLS, "Let me check.",
     [("get_weather", '{"location": "Beijing"}'), ("get_time", '{"zone": "UTC+8", "fmt": "24h"}')]),
    (V31, V31_TWO_CALLS, None,
     [("get_weather", '{"location": "杭州"}'), ("get_time", '{"zone": "UTC+8", "fmt": "24h"}')]),
    (V31, "Sure: " + V31_TWO_CALLS.split(CALL_END)[0] + CALL_END + CALLS_END + " done.", "Sure:  done.",
     [("get_weather", '{"location": "杭州"}')]),
    # A model that stops right after its last call, without calls-end.
    (V31, V31_TWO_CALLS[:-len(CALLS_END)], None,
     [("get_weather", '{"location": "杭州"}'), ("get_time", '{"zone": "UTC+8", "fmt": "24h"}')]),
    (V3, "no calls here, only text with a < and a ｜", "no calls here, only text with a < and a ｜", []),
]


def _calls(parsed):
    return [(c.name, c.arguments) for c in parsed.calls]


@pytest.mark.parametrize("fmt, text, content, calls", WELL_FORMED)
def test_parse_whole(fmt, text, content, calls):
    parsed = parse_tool_calls(fmt, text)
    assert parsed.content == content and _calls(parsed) == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in parsed.calls)
    assert len({c.id for c in parsed.calls}) == len(calls)


def test_single_call_and_max_calls():
    text = V31_TWO_CALLS
    first = parse_tool_calls(V31, text, max_calls=1)
    assert _calls(first) == [("get_weather", '{"location": "杭州"}')] and first.content is None
    one = V3.render_calls([("f", "{}")])
    assert one == (CALLS_BEGIN + CALL_BEGIN + "function" + TOOL_SEP + "f\n```json\n{}\n```" + CALL_END
                   + CALLS_END)
    assert _calls(parse_tool_calls(V3, one)) == [("f", "{}")]


@pytest.mark.parametrize("fmt, text", [
    (V31, V31_TWO_CALLS.replace('"杭州"}', '"杭州"')),                      # arguments not JSON
    (V31, V31_TWO_CALLS.replace('{"zone"', '["zone"').replace('"24h"}', '"24h"]')),   # not an object
    (V31, V31_TWO_CALLS.replace(CALL_END + CALL_BEGIN, CALL_END + "oops" + CALL_BEGIN)),
    (V31, V31_TWO_CALLS.replace("get_time", "get time")),                    # a name with a space
    (V31, CALLS_BEGIN + CALL_BEGIN + TOOL_SEP + "{}" + CALL_END + CALLS_END),   # no name
    (V3, V3_TWO_CALLS.replace("function<｜tool▁sep｜>get_time", "get_time")),  # no "function" type
    (V31, V31_TWO_CALLS[:-40]),                                              # cut inside a call
    (V31, "text" + CALLS_BEGIN),                                              # a block with no call
    (V31, CALLS_BEGIN + CALL_BEGIN + "x" * 70 + TOOL_SEP + "{}" + CALL_END),  # name over 64 chars
])
def test_malformed_is_content(fmt, text):
    parsed = parse_tool_calls(fmt, text)
    assert parsed.calls == [] and parsed.content == text


def _stream(fmt, pieces, max_calls=None):
    parser = ToolCallStreamParser(fmt, max_calls)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls: dict[int, list] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                assert e.index not in calls, "a call's id and name come once, first"
                calls[e.index] = [e.name, ""]
            calls[e.index][1] += e.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)], events


@pytest.mark.parametrize("fmt, text, content, calls", WELL_FORMED)
def test_stream_equals_whole_at_every_split(fmt, text, content, calls):
    for cut in range(len(text) + 1):
        got = _stream(fmt, [text[:cut], text[cut:]])
        assert (got[0] or None, got[1]) == (content, calls), cut
    got_content, got_calls, events = _stream(fmt, list(text))          # one character at a time
    assert (got_content or None, got_calls) == (content, calls)
    # No piece of a marker is ever streamed as content.
    for e in events:
        if isinstance(e, str):
            assert "<｜" not in e and "｜>" not in e


def test_stream_max_calls_drops_later_calls():
    content, calls, _ = _stream(V31, list(V31_TWO_CALLS), max_calls=1)
    assert content == "" and calls == [("get_weather", '{"location": "杭州"}')]


def test_stream_gives_back_a_broken_block():
    text = "a" + CALLS_BEGIN + "not a call" + " tail"
    content, calls, _ = _stream(V31, list(text))
    assert content == text and calls == []


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL)


def _token_pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    """``text`` as the detokenizer streams it: one piece per token of the embedded
    tokenizer (a multi-byte character split over tokens arrives whole, later)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    pieces = []
    for tid in ids:
        detok.add_tokens([tid])
        pieces.append(detok.stream_delta(finished=False))
    pieces.append(detok.stream_delta(finished=True))
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("fmt, text, content, calls", WELL_FORMED[:2])
def test_stream_at_token_boundaries(tokenizer, fmt, text, content, calls):
    pieces = _token_pieces(tokenizer, text)
    assert len(pieces) > 100        # the markers are spelled with many byte-level tokens here
    got = _stream(fmt, pieces)
    assert (got[0] or None, got[1]) == (content, calls)


# -- reasoning ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, reasoning, content", [
    ("<think>Plan: add.</think>The sum is 3.", "Plan: add.", "The sum is 3."),
    ("Plan: add.</think>The sum is 3.", "Plan: add.", "The sum is 3."),       # opener in the prompt
    ("Still thinking <th", "Still thinking <th", None),                        # never closed: all reasoning
    ("</think>Answer", None, "Answer"),
    ("<think></think>", None, None),
    ("", None, None),
    ("a</think>b</think>c", "a", "b</think>c"),
    ("x <think>y</think>z", "x <think>y", "z"),                                # an opener only counts first
])
def test_split_reasoning(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


def _split_stream(pieces):
    s = ReasoningStreamSplitter()
    parts = [s.feed(p) for p in pieces] + [s.finish()]
    for r, c in parts:
        assert "</think>" not in r and "</think>" not in c
    return "".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None


@pytest.mark.parametrize("text", ["<think>Plan: add.</think>The sum is 3.", "Plan</think>Answer",
                                  "<think>only reasoning", "</think>x", "<thin", "a<b</thinkc</think>d"])
def test_reasoning_stream_at_every_split_and_token(tokenizer, text):
    whole = split_reasoning(text)
    for cut in range(len(text) + 1):
        assert _split_stream([text[:cut], text[cut:]]) == whole, cut
    assert _split_stream(list(text)) == whole
    assert _split_stream(_token_pieces(tokenizer, text)) == whole


def test_reasoning_parsers():
    v3, r1 = get_reasoning_parser("deepseek_v3"), get_reasoning_parser("deepseek_r1")
    assert not v3.enabled(None) and not v3.enabled({"thinking": False})
    assert v3.enabled({"thinking": True}) and v3.enabled({"enable_thinking": True})
    assert r1.enabled(None) and r1.enabled({"thinking": False})
    assert set(REASONING_PARSERS) == {"deepseek_r1", "deepseek_v3"}
    with pytest.raises(ValueError, match="reasoning parser 'qwen3' is not known; known: deepseek_r1, deepseek_v3"):
        get_reasoning_parser("qwen3")
    with pytest.raises(ValueError, match="tool call parser 'hermes' is not known; known: deepseek_v3, deepseek_v31"):
        get_tool_call_format("hermes")


# -- the grammar that forces calls ------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"]}


@pytest.fixture(scope="module")
def backend(tokenizer) -> XGrammarBackend:
    return XGrammarBackend.from_tokenizer_file(f"{DEFAULT_MODEL}/tokenizer.json", tokenizer.vocab_size,
                                               tokenizer.eos_token_ids, tokenizer.all_special_ids)


def _accepts(backend, tokenizer, fmt_dict, text) -> bool:
    tag = {"type": "structural_tag", "format": fmt_dict}
    m = backend.compile(StructuredOutputsParams(structural_tag=tag)).new_matcher()
    ok = all(m.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok and m.accept_token(min(tokenizer.eos_token_ids)) and m.is_terminated()


@pytest.mark.parametrize("fmt", [V3, V31])
def test_forced_calls_grammar(backend, tokenizer, fmt):
    functions = [("get_weather", SCHEMA), ("noop", {"type": "object", "properties": {}})]
    one = fmt.calls_format(functions, parallel=False)
    many = fmt.calls_format(functions, parallel=True)
    call = ("get_weather", '{"city": "Tokyo", "days": 3}')
    assert _accepts(backend, tokenizer, one, fmt.render_calls([call]))
    assert _accepts(backend, tokenizer, many, fmt.render_calls([call, ("noop", "{}")]))
    assert not _accepts(backend, tokenizer, one, fmt.render_calls([call, ("noop", "{}")]))   # one call only
    assert not _accepts(backend, tokenizer, many, fmt.render_calls([("get_weather", '{"city": "Rome", "days": 3}')]))
    assert not _accepts(backend, tokenizer, many, fmt.render_calls([("get_weather", '{"city": "Paris"}')]))
    assert not _accepts(backend, tokenizer, many, fmt.render_calls([("other", "{}")]))
    assert not _accepts(backend, tokenizer, many, "Sure. " + fmt.render_calls([call]))
    assert not _accepts(backend, tokenizer, many, CALLS_BEGIN + CALLS_END)                  # at least one call
    # Thinking first: free text up to </think>, then the calls.
    thinking = {"type": "sequence", "elements": [REASONING_PARSERS["deepseek_v3"].grammar_prefix(), many]}
    assert _accepts(backend, tokenizer, thinking, "I should look it up.</think>" + fmt.render_calls([call]))
    assert not _accepts(backend, tokenizer, thinking, fmt.render_calls([call]))


def test_tools_prompt_describes_each_function_and_the_format():
    functions = [{"name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA},
                 {"name": "noop"}]
    for fmt in (V3, V31):
        prompt = fmt.tools_prompt(functions)
        assert "### get_weather\nDescription: Weather of a city" in prompt
        assert f"Parameters: {json.dumps(SCHEMA, ensure_ascii=False)}" in prompt
        assert "### noop\nDescription: \n\nParameters: {}" in prompt
        assert fmt.render_call("tool_call_name", "tool_call_arguments") in prompt


@pytest.mark.parametrize("spec, good, bad", [
    ({"json": SCHEMA}, '{"city": "Paris", "days": 2}', '{"city": "Rome", "days": 2}'),
    ({"json_object": True}, '{"any": [1, 2]}', "[1, 2]"),
    ({"regex": "[ab]{3}"}, "aba", "abc"),
    ({"choice": ["yes", "no"]}, "no", "maybe"),
    ({"grammar": 'root ::= "x"+'}, "xxx", "xy"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}}, "hi", "ho"),
])
def test_constraints_start_after_reasoning(backend, tokenizer, spec, good, bad):
    """A thinking request's output constraint applies after </think>: the reasoning is free."""
    from types import SimpleNamespace

    from deepinfer.entrypoints.openai.chat import _grammar

    state = SimpleNamespace(tool_format=V31, reasoning=get_reasoning_parser("deepseek_v3"))
    params = _grammar(state, None, True, StructuredOutputsParams(**spec), "structured_outputs")
    tag = params.structural_tag
    assert _accepts(backend, tokenizer, tag["format"], "Any {thought}: [here]</think>" + good)
    assert not _accepts(backend, tokenizer, tag["format"], "Any thought</think>" + bad)
    assert not _accepts(backend, tokenizer, tag["format"], good)          # the block must close first
    # Without thinking the request's own grammar is used as it is.
    assert _grammar(state, None, False, StructuredOutputsParams(**spec), "structured_outputs").kind == \
        next(iter(spec))
