"""DeepSeek tool-call and reasoning parsing without a server: hand-written text in the
token formats (V3, V3.1) and the DSML formats (V3.2, V4, V4.1): single and parallel calls,
string and JSON parameters, malformed blocks; streaming at every split point and at the
embedded tokenizer's token boundaries, the grammar that forces calls, the fallback tool
prompt, the default format of a model."""

from __future__ import annotations

import json

import pytest

from deepinfer.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.entrypoints.openai.reasoning import (REASONING_PARSERS, ReasoningStreamSplitter,
                                                    get_reasoning_parser, split_reasoning)
from deepinfer.entrypoints.openai.tool_parsers import (CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END,
                                                       TOOL_CALL_FORMATS, TOOL_SEP, ToolCallDelta,
                                                       default_tool_call_parser, get_tool_call_format,
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
    parser = fmt.stream_parser(max_calls)
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


# -- DSML (DeepSeek-V3.2, V4, V4.1) -------------------------------------------------------------------
V32 = TOOL_CALL_FORMATS["deepseek_v32"]
V4 = TOOL_CALL_FORMATS["deepseek_v4"]
V41 = TOOL_CALL_FORMATS["deepseek_v41"]

# Written out by hand as DeepSeek's encodings lay calls out: a blank line after the text,
# one parameter a line, string="true" values as raw text, the others as JSON.
V32_TWO_CALLS = ('Let me check.\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                 '<｜DSML｜parameter name="location" string="true">杭州</｜DSML｜parameter>\n'
                 '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                 '<｜DSML｜invoke name="get_weather">\n'
                 '<｜DSML｜parameter name="location" string="true">北京</｜DSML｜parameter>\n'
                 '<｜DSML｜parameter name="days" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
                 '</｜DSML｜function_calls>')
V4_NESTED = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n'
             '<｜DSML｜parameter name="query" string="true">say "hi"\\n\tto C:\\dir\n'
             'then {"not": json}</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="filters" string="false">{"tags": ["a", "b"], "range": {"lo": 1.5, "hi": null},'
             ' "strict": true}</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="limit" string="false"> 20 </｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="code" string="true">007</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
V41_CALL = ('\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="ns::ping">\n\n</｜DSML｜ invoke>\n'
            '<｜DSML｜ invoke name="add">\n<｜DSML｜ parameter name="a" string="false">2</｜DSML｜ parameter>'
            '<｜DSML｜ parameter name="b" string="false">-3e2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
            '</｜DSML｜ calls>')
V4_NESTED_ARGS = json.dumps({"query": 'say "hi"\\n\tto C:\\dir\nthen {"not": json}',
                             "filters": {"tags": ["a", "b"], "range": {"lo": 1.5, "hi": None}, "strict": True},
                             "limit": 20, "code": "007"}, ensure_ascii=False)
DSML_WELL_FORMED = [
    (V32, V32_TWO_CALLS, "Let me check.",
     [("get_weather", '{"location": "杭州", "days": 3}'), ("get_weather", '{"location": "北京", "days": 1}')]),
    (V4, V4_NESTED, None, [("search", V4_NESTED_ARGS)]),
    (V41, V41_CALL, None, [("ns::ping", "{}"), ("add", '{"a": 2, "b": -3e2}')]),
    # Text after the block is content too; a model may stop without the block's end tag.
    (V4, "Sure." + V4_NESTED + "\nDone.", "Sure.\nDone.", [("search", V4_NESTED_ARGS)]),
    (V4, "\n" + V4_NESTED + "\n\n", None, [("search", V4_NESTED_ARGS)]),
    (V32, V32_TWO_CALLS[:-len("</｜DSML｜function_calls>")], "Let me check.",
     [("get_weather", '{"location": "杭州", "days": 3}'), ("get_weather", '{"location": "北京", "days": 1}')]),
    # Another format's block, or DSML-looking text without a block, is content.
    (V41, V4_NESTED, V4_NESTED, []),
    (V32, 'a <｜DSML｜invoke name="x"> b \n\n', 'a <｜DSML｜invoke name="x"> b \n\n', []),
]


@pytest.mark.parametrize("fmt, text, content, calls", DSML_WELL_FORMED)
def test_dsml_parse_whole(fmt, text, content, calls):
    parsed = parse_tool_calls(fmt, text)
    assert parsed.content == content and _calls(parsed) == calls
    for c in parsed.calls:
        assert c.id.startswith("call_") and isinstance(json.loads(c.arguments), dict)
    assert len({c.id for c in parsed.calls}) == len(calls)


@pytest.mark.parametrize("fmt, text, content, calls", DSML_WELL_FORMED)
def test_dsml_stream_equals_whole_at_every_split(fmt, text, content, calls):
    for cut in range(len(text) + 1):
        got = _stream(fmt, [text[:cut], text[cut:]])
        assert (got[0] or None, got[1]) == (content, calls), cut
    got_content, got_calls, events = _stream(fmt, list(text))          # one character at a time
    assert (got_content or None, got_calls) == (content, calls)
    if calls:                       # no piece of the block is ever streamed as content
        assert not any(isinstance(e, str) and "DSML" in e for e in events)
        assert sum(isinstance(e, ToolCallDelta) for e in events) > 2 * len(calls)     # arguments in pieces


@pytest.mark.parametrize("fmt, text, content, calls", DSML_WELL_FORMED[:3])
def test_dsml_stream_at_token_boundaries(tokenizer, fmt, text, content, calls):
    got = _stream(fmt, _token_pieces(tokenizer, text))
    assert (got[0] or None, got[1]) == (content, calls)


P = '<｜DSML｜parameter name="'
P_END = "</｜DSML｜parameter>"


@pytest.mark.parametrize("fmt, text", [
    (V32, V32_TWO_CALLS.replace('string="false">3', 'string="false">three')),        # not JSON
    (V32, V32_TWO_CALLS.replace('string="false">3', 'string="false">NaN')),          # not strict JSON
    (V32, V32_TWO_CALLS.replace('string="false">1', 'string="false">{"a": 1')),
    (V32, V32_TWO_CALLS.replace('"days" string="false"', '"days"')),                # no string attribute
    (V32, V32_TWO_CALLS.replace('string="false"', 'string="maybe"', 1)),
    (V32, V32_TWO_CALLS.replace('"days"', '"location"', 1)),                         # a parameter twice
    (V32, V32_TWO_CALLS.replace("</｜DSML｜invoke>\n<｜DSML｜invoke", "</｜DSML｜invoke>\noops<｜DSML｜invoke")),
    (V32, V32_TWO_CALLS.replace('\n<｜DSML｜parameter name="days"', 'x<｜DSML｜parameter name="days"', 1)),
    (V32, V32_TWO_CALLS.replace('invoke name="get_weather"', 'invoke name="get weather"', 1)),
    (V32, V32_TWO_CALLS.replace('invoke name="get_weather"', 'invoke name=""', 1)),
    (V32, V32_TWO_CALLS.replace('invoke name="get_weather"', 'invoke name="' + "x" * 70 + '"', 1)),
    (V32, V32_TWO_CALLS.replace('invoke name="get_weather">', 'invoke name="get_weather" id="1">', 1)),
    (V32, V32_TWO_CALLS[:-60]),                                                       # cut inside a call
    (V32, V32_TWO_CALLS.replace(P_END + "\n</｜DSML｜invoke>", "\n</｜DSML｜invoke>", 1)),   # parameter not closed
    (V32, "text\n\n<｜DSML｜function_calls>\n"),                                       # a block with no call
    (V32, "<｜DSML｜function_calls>\n" + P + 'a" string="true">x' + P_END),           # a parameter outside a call
    (V32, '<｜DSML｜function_calls><｜DSML｜invoke name="f">' + P + "a" * 300),       # a header that never closes
    (V41, V41_CALL.replace("｜ invoke", "｜invoke")),                                 # V4.1 tags need the space
])
def test_dsml_malformed_is_content(fmt, text):
    parsed = parse_tool_calls(fmt, text)
    assert parsed.calls == [] and parsed.content == text


def test_dsml_stream_gives_back_a_broken_block_and_keeps_max_calls():
    text = "a\n\n<｜DSML｜tool_calls>\nnot a call tail"
    content, calls, _ = _stream(V4, list(text))
    assert content == text and calls == []
    content, calls, _ = _stream(V32, list(V32_TWO_CALLS), max_calls=1)
    assert content == "Let me check." and calls == [("get_weather", '{"location": "杭州", "days": 3}')]
    first = parse_tool_calls(V32, V32_TWO_CALLS, max_calls=1)
    assert _calls(first) == [("get_weather", '{"location": "杭州", "days": 3}')]


def test_dsml_stream_cut_inside_a_string_value():
    """A stream that stops inside a call (max_tokens) keeps the string value it has: the
    call was announced and stays incomplete, so the output is not a tool-call finish."""
    text = V32_TWO_CALLS.split("北")[0]
    parser = V32.stream_parser()
    events = [e for piece in text for e in parser.feed(piece)] + parser.finish()
    args = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta) and e.index == 1)
    assert args == '{"location": "' and parser.malformed and [c.complete for c in parser.calls] == [True, False]


@pytest.mark.parametrize("fmt", [V32, V4, V41])
def test_dsml_render_calls_round_trips(fmt):
    calls = [("get_weather", '{"city": "Paris", "days": 3}'), ("noop", "{}"),
             ("echo", json.dumps({"text": "two\nlines \"quoted\" </tag>", "n": [1, {"x": None}], "ok": False}))]
    text = fmt.render_calls(calls)
    assert text.startswith("\n\n" + fmt.calls_begin + "\n") and text.endswith("\n" + fmt.calls_end)
    assert f'{fmt.parameter_begin}city" string="true">Paris{fmt.parameter_end}' in text
    assert f'{fmt.parameter_begin}days" string="false">3{fmt.parameter_end}' in text
    parsed = parse_tool_calls(fmt, "Done." + text)
    assert parsed.content == "Done."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [(n, json.loads(a)) for n, a in calls]
    with pytest.raises(ValueError, match=r"function.arguments of the call to 'f' must be a JSON object, not list"):
        fmt.render_calls([("f", "[1]")])
    with pytest.raises(ValueError, match=r"function.arguments of the call to 'f' is not JSON"):
        fmt.render_calls([("f", "{")])


def test_dsml_tools_prompt_and_tool_outputs():
    functions = [{"name": "get_weather", "description": "Weather of a city", "parameters": SCHEMA}]
    for fmt in (V32, V4, V41):
        prompt = fmt.tools_prompt(functions)
        assert json.dumps(functions[0], ensure_ascii=False) in prompt
        assert f'{fmt.calls_begin}\n{fmt.invoke_begin}$TOOL_NAME">\n{fmt.parameter_begin}$PARAMETER_NAME"' in prompt
        assert 'string="true"' in prompt and 'string="false"' in prompt
    assert V32.render_tool_outputs(["a", "b", "c"]) == ["<function_results>\n<result>a</result>", "<result>b</result>",
                                                        "<result>c</result>\n</function_results>"]
    assert V32.render_tool_outputs(["a"]) == ["<function_results>\n<result>a</result>\n</function_results>"]
    assert V41.render_tool_outputs(["a", "b"]) == V4.render_tool_outputs(["a", "b"]) == [
        "<tool_result>a</tool_result>", "<tool_result>b</tool_result>"]


@pytest.mark.parametrize("hf_config, parser", [
    ({"model_type": "deepseek_v32", "architectures": ["DeepseekV32ForCausalLM"]}, "deepseek_v32"),
    ({"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"]}, "deepseek_v4"),
    ({"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"]}, "deepseek_v41"),
    ({"architectures": ["DeepseekV4ForCausalLM"]}, "deepseek_v4"),             # no model_type: the architecture
    ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, "deepseek_v3"),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "deepseek_v3"),
])
def test_default_tool_call_parser(hf_config, parser):
    assert default_tool_call_parser(hf_config) == parser


def test_default_parser_of_the_embedded_model():
    from deepinfer.config import flatten_text_config, read_hf_config

    assert default_tool_call_parser(flatten_text_config(read_hf_config(DEFAULT_MODEL))) == "deepseek_v41"


@pytest.mark.parametrize("fmt", [V32, V4, V41])
def test_dsml_forced_calls_grammar(backend, tokenizer, fmt):
    nested = {"type": "object", "properties": {"q": {"type": "string"},
                                               "f": {"type": "object", "properties": {"n": {"type": "integer"}},
                                                     "required": ["n"]}}, "required": ["q", "f"]}
    functions = [("get_weather", SCHEMA), ("noop", {"type": "object", "properties": {}}), ("find", nested)]
    one = fmt.calls_format(functions, parallel=False)
    many = fmt.calls_format(functions, parallel=True)
    call = ("get_weather", '{"city": "Tokyo", "days": 3}')
    find = ("find", '{"q": "a \\"b\\"", "f": {"n": 2}}')
    assert _accepts(backend, tokenizer, one, fmt.render_calls([call]))
    assert _accepts(backend, tokenizer, one, fmt.render_calls([find]))
    assert _accepts(backend, tokenizer, many, fmt.render_calls([call, ("noop", "{}"), find]))
    assert not _accepts(backend, tokenizer, one, fmt.render_calls([call, ("noop", "{}")]))   # one call only
    for bad in ('{"city": "Rome", "days": 3}', '{"city": "Paris"}', '{"city": "Paris", "days": 30}'):
        assert not _accepts(backend, tokenizer, many, fmt.render_calls([("get_weather", bad)]))
    assert not _accepts(backend, tokenizer, many, fmt.render_calls([("find", '{"q": "x", "f": {"n": "2"}}')]))
    assert not _accepts(backend, tokenizer, many, fmt.render_calls([("other", "{}")]))
    assert not _accepts(backend, tokenizer, many, "Sure." + fmt.render_calls([call]))
    assert not _accepts(backend, tokenizer, many, f"\n\n{fmt.calls_begin}\n{fmt.calls_end}")   # at least one call
    thinking = {"type": "sequence", "elements": [REASONING_PARSERS["deepseek_v3"].grammar_prefix(), many]}
    assert _accepts(backend, tokenizer, thinking, "I should look it up.</think>" + fmt.render_calls([call]))
    assert not _accepts(backend, tokenizer, thinking, fmt.render_calls([call]))
