"""Every request field of /v1/completions and /v1/chat/completions, in every model a
request holds, is honoured, refused or documented: no field is silently ignored.

The test walks the protocol models (pydantic ``model_fields``) and finds each field
("Model.field") in CASES, where it is sent with a non-default value and checked for:

- ``Differs``: the outcome (the prompt the engine got, the text, finish reasons, tool
  calls, reasoning) differs from the same request without the field;
- ``Holds``: an expected property of the response (a 404, a regex match, usage...);
- ``Refused``: a 400 naming the field (protocol.REFUSED_FIELDS, or a value outside
  the field's closed set);
- ``Passed``: the value reaches the tokenizer or the chat template as it is
  (protocol.PASSTHROUGH_FIELDS: the checkpoint decides what it does);
- ``NoOp``: the outcome is the same with and without it (protocol.NO_OP_FIELDS).

A field added to a request model without a case here fails ``test_every_field_has_a_case``.
"""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx2
import pytest
from pydantic import BaseModel

from deepinfer.engine.engine import Engine
from deepinfer.entrypoints.openai.protocol import (NO_OP_FIELDS, PASSTHROUGH_FIELDS, REFUSED_FIELDS,
                                                   ChatCompletionRequest, CompletionRequest)
from deepinfer.entrypoints.openai.tool_parsers import CALL_BEGIN
from tests.server.conftest import MODEL, RunningServer, serve

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Seeded sampling (temperature 1) with EOS ignored: deterministic and of a known length.
BASE = {
    "completions": {"model": MODEL, "prompt": "The list type", "max_tokens": 4, "seed": 0, "ignore_eos": True},
    "chat": {"model": MODEL, "messages": [{"role": "user", "content": "What is a list?"}], "max_tokens": 4,
             "seed": 0, "ignore_eos": True},
}
# Greedy prompts whose outputs repeat tokens, so that penalties show.
GREEDY = {
    "completions": {"prompt": "Return a new dictionary", "temperature": 0, "max_tokens": 12},
    "chat": {"messages": [{"role": "user", "content": "Return a new dictionary"}], "temperature": 0,
             "max_tokens": 12},
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
TOOL_TURN = [{"role": "user", "content": "Weather in Paris?"}, ASSISTANT_CALL,
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
EOS = 2                # <|im_end|>
SPECIAL = 1            # <|im_start|>, special but not a stop token
PLAIN = 300            # an ordinary token


# -- running a request ------------------------------------------------------------------------------
@dataclass
class Outcome:
    status: int
    body: dict[str, Any] | None                 # the JSON response (None when streamed)
    events: list[dict[str, Any]]                # the SSE events (streamed)
    prompts: list[list[int]]                    # what the engine was asked to continue
    params: list[Any]                           # the SamplingParams it got
    templates: list[dict[str, Any]]             # apply_chat_template calls: messages and variables
    encodes: list[bool]                         # add_special_tokens of each tokenizer.encode call

    @property
    def choices(self) -> list[dict[str, Any]]:
        return self.body["choices"]

    def text(self, i: int = 0) -> str:
        c = self.choices[i]
        return c["text"] if "text" in c else c["message"]["content"]

    def key(self) -> tuple:
        """What "the same outcome" compares: the prompt and everything generated."""
        if self.body is None:
            return self.status, tuple(map(tuple, self.prompts)), json.dumps(self.events, sort_keys=True)
        choices = []
        for c in self.choices:
            message = dict(c.get("message") or {})
            for call in message.get("tool_calls") or []:
                call.pop("id")
            choices.append((c.get("text"), json.dumps(message, sort_keys=True), c["finish_reason"],
                            json.dumps(c.get("logprobs"), sort_keys=True)))
        return self.status, tuple(map(tuple, self.prompts)), tuple(choices)


def _run(server: RunningServer, route: str, body: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Outcome:
    state = server.app.state.server_state
    out = Outcome(0, None, [], [], [], [], [])
    add, render, encode = state.engine.add_requests, state.tokenizer.apply_chat_template, state.tokenizer.encode

    async def spy_add(requests, queue):
        out.prompts += [list(ids) for _, ids, _ in requests]
        out.params += [params for _, _, params in requests]
        return await add(requests, queue)

    def spy_render(messages, add_generation_prompt=True, **kwargs):
        out.templates.append({"messages": messages, **kwargs})
        return render(messages, add_generation_prompt, **kwargs)

    def spy_encode(text, add_special_tokens=True):
        out.encodes.append(add_special_tokens)
        return encode(text, add_special_tokens)

    with monkeypatch.context() as m:
        m.setattr(state.engine, "add_requests", spy_add)
        m.setattr(state.tokenizer, "apply_chat_template", spy_render)
        m.setattr(state.tokenizer, "encode", spy_encode)
        with httpx2.Client(timeout=120) as http:
            resp = http.post(server.url + ROUTES[route], json=body)
    out.status = resp.status_code
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        out.events = [json.loads(line[6:]) for line in resp.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    else:
        out.body = resp.json()
    return out


# -- cases ------------------------------------------------------------------------------------------
Body = dict[str, Any]


@dataclass
class Differs:
    route: str
    body: Body
    base: Body = field(default_factory=dict)      # over BASE[route]; the request without the field


@dataclass
class Holds:
    route: str
    body: Body | Callable[[Outcome], Body]        # a callable builds it from the base outcome
    check: Callable[[Outcome, Outcome], bool]     # (outcome, base outcome) -> whether it holds


@dataclass
class Refused:
    route: str
    body: Body
    param: str


@dataclass
class Passed:
    route: str
    body: Body
    check: Callable[[Outcome], bool]


@dataclass
class NoOp:
    route: str
    body: Body
    base: Body = field(default_factory=dict)


def _length(n: int) -> Callable[[Outcome, Outcome], bool]:
    return lambda o, _: o.body["usage"]["completion_tokens"] == n


def _matches(pattern: str) -> Callable[[Outcome, Outcome], bool]:
    return lambda o, _: re.fullmatch(pattern, o.text(), re.S) is not None


def _json_start(o: Outcome, _: Outcome) -> bool:
    return o.text().lstrip().startswith("{")       # constrained from the first token on


def _stop_at(o: Outcome, base: Outcome) -> bool:
    stop = base.text()[1:3]
    return o.choices[0]["finish_reason"] == "stop" and o.text() == base.text()[:base.text().index(stop)]


def _stop_kept(o: Outcome, base: Outcome) -> bool:
    stop = base.text()[1:3]
    return o.choices[0]["finish_reason"] == "stop" and o.text() == base.text()[:base.text().index(stop) + 2]


def _finish(reason: str, tokens: int, stop_reason: Any = None) -> Callable[[Outcome, Outcome], bool]:
    return lambda o, _: (o.choices[0]["finish_reason"] == reason and o.choices[0]["stop_reason"] == stop_reason
                         and o.body["usage"]["completion_tokens"] == tokens)


def _repeats(o: Outcome, _: Outcome) -> bool:
    """The text is four copies of one token's text."""
    text = o.text()
    return len(text) > 0 and text == text[:len(text) // 4] * 4


def _stream_text(o: Outcome) -> str:
    parts = []
    for e in o.events:
        for c in e.get("choices", []):
            parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(parts)


def _streams_base_text(o: Outcome, base: Outcome) -> bool:
    return o.status == 200 and o.body is None and _stream_text(o) == base.text()


def _streams_usage(o: Outcome, base: Outcome) -> bool:
    # The token counts equal the whole response's; the cached count may differ (one of the two
    # requests can hit the prefix cache the other filled).
    def counts(usage: dict) -> dict:
        return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
    return o.events[-1]["choices"] == [] and counts(o.events[-1]["usage"]) == counts(base.body["usage"])


def _one_call_at_most(o: Outcome, _: Outcome) -> bool:
    tag = o.params[0].structured_outputs.structural_tag
    tag = tag if isinstance(tag, dict) else json.loads(tag)
    return tag["format"]["content"]["stop_after_first"] is True


def _template_var(name: str, value: Any) -> Callable[[Outcome], bool]:
    return lambda o: bool(o.templates) and o.templates[-1].get(name) == value


def _in_messages(value: Any, get: Callable[[dict], Any]) -> Callable[[Outcome], bool]:
    return lambda o: any(get(m) == value for m in o.templates[-1]["messages"])


def _sampling_cases(route: str) -> dict[str, Any]:
    model = "CompletionRequest" if route == "completions" else "ChatCompletionRequest"
    greedy = GREEDY[route]
    cases = {
        "model": Holds(route, {"model": "no-such-model"}, lambda o, _: o.status == 404),
        "n": Holds(route, {"n": 2}, lambda o, _: len(o.choices) == 2),
        "temperature": Differs(route, {"temperature": 0}),
        "top_p": Differs(route, {"top_p": 0.01}),
        "top_k": Differs(route, {"top_k": 1}),
        "min_p": Differs(route, {"min_p": 0.9}),
        "seed": Differs(route, {"seed": 1}),
        "frequency_penalty": Differs(route, {**greedy, "frequency_penalty": 2.0}, greedy),
        "presence_penalty": Differs(route, {**greedy, "presence_penalty": 2.0}, greedy),
        "repetition_penalty": Differs(route, {**greedy, "repetition_penalty": 3.0}, greedy),
        "logit_bias": Holds(route, {"logit_bias": {str(PLAIN): 100}}, _repeats),
        "stop": Holds(route, lambda base: {"stop": [base.text()[1:3]]}, _stop_at),
        "include_stop_str_in_output": Holds(
            route, lambda base: {"stop": [base.text()[1:3]], "include_stop_str_in_output": True}, _stop_kept),
        "stream": Holds(route, {"stream": True}, _streams_base_text),
        "stream_options": Holds(route, {"stream": True, "stream_options": {"include_usage": True}},
                                _streams_usage),
        "user": NoOp(route, {"user": "user-1234"}),
        "ignore_eos": Holds(route, {"logit_bias": {str(EOS): 100}, "ignore_eos": True}, _finish("length", 4)),
        "min_tokens": Holds(route, {"logit_bias": {str(EOS): 100}, "ignore_eos": False, "min_tokens": 3},
                            _finish("stop", 4)),
        "stop_token_ids": Holds(route, {"logit_bias": {str(PLAIN): 100}, "stop_token_ids": [PLAIN]},
                                _finish("stop", 1, PLAIN)),
        "skip_special_tokens": Holds(route, {"logit_bias": {str(SPECIAL): 100}, "skip_special_tokens": False},
                                     lambda o, _: o.text() == "<|im_start|>" * 4),
        "response_format": Holds(route, {"response_format": {"type": "json_object"}, "max_tokens": 3},
                                 _json_start),
        "structured_outputs": Holds(route, {"structured_outputs": {"regex": "[ab]{3}"}}, _matches("[ab]{3}")),
        "guided_json": Holds(route, {"guided_json": SCHEMA, "max_tokens": 3}, _json_start),
        "guided_regex": Holds(route, {"guided_regex": "[xy]{2}"}, _matches("[xy]{2}")),
        "guided_choice": Holds(route, {"guided_choice": ["yes", "no"]}, _matches("yes|no")),
        "guided_grammar": Holds(route, {"guided_grammar": 'root ::= "x" "y" "z"'}, _matches("xyz")),
    }
    return {f"{model}.{name}": case for name, case in cases.items()}


CASES: dict[str, Any] = {
    **_sampling_cases("completions"),
    **_sampling_cases("chat"),
    # -- /v1/completions ------------------------------------------------------------------------
    "CompletionRequest.prompt": Differs("completions", {"prompt": "A dictionary maps keys"}),
    "CompletionRequest.max_tokens": Holds("completions", {"max_tokens": 2}, _length(2)),
    "CompletionRequest.echo": Holds("completions", {"echo": True},
                                    lambda o, b: o.text() == "The list type" + b.text()),
    "CompletionRequest.logprobs": Holds("completions", {"logprobs": 2}, lambda o, _: all(
        2 <= len(t) <= 3 for t in o.choices[0]["logprobs"]["top_logprobs"])),
    "CompletionRequest.best_of": Refused("completions", {"best_of": 3}, "best_of"),
    "CompletionRequest.suffix": Refused("completions", {"suffix": "end"}, "suffix"),
    "CompletionRequest.prompt_logprobs": Holds("completions", {"prompt_logprobs": 1}, lambda o, _: len(
        o.choices[0]["prompt_logprobs"]) == len(o.prompts[0])),
    "CompletionRequest.add_special_tokens": Passed("completions", {"add_special_tokens": False},
                                                   lambda o: o.encodes == [False]),
    # -- /v1/chat/completions --------------------------------------------------------------------
    "ChatCompletionRequest.messages": Differs("chat", {"messages": [{"role": "user", "content": "Hi"}]}),
    "ChatCompletionRequest.max_tokens": Holds("chat", {"max_tokens": 2}, _length(2)),
    "ChatCompletionRequest.max_completion_tokens": Holds("chat", {"max_completion_tokens": 2}, _length(2)),
    "ChatCompletionRequest.logprobs": Holds("chat", {"logprobs": True}, lambda o, _: len(
        o.choices[0]["logprobs"]["content"]) == 4),
    "ChatCompletionRequest.top_logprobs": Holds("chat", {"logprobs": True, "top_logprobs": 3}, lambda o, _: all(
        len(t["top_logprobs"]) == 3 for t in o.choices[0]["logprobs"]["content"])),
    "ChatCompletionRequest.tools": Differs("chat", {"tools": TOOLS}),
    "ChatCompletionRequest.tool_choice": Differs("chat", {"tools": TOOLS, "tool_choice": "none"}, {"tools": TOOLS}),
    "ChatCompletionRequest.parallel_tool_calls": Holds(
        "chat", {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 1},
        _one_call_at_most),
    "ChatCompletionRequest.reasoning_effort": Passed("chat", {"reasoning_effort": "high"},
                                                     _template_var("reasoning_effort", "high")),
    "ChatCompletionRequest.functions": Refused("chat", {"functions": [{"name": "f"}]}, "functions"),
    "ChatCompletionRequest.function_call": Refused("chat", {"function_call": "auto"}, "function_call"),
    "ChatCompletionRequest.audio": Refused("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    "ChatCompletionRequest.modalities": Refused("chat", {"modalities": ["text", "audio"]}, "modalities"),
    "ChatCompletionRequest.prediction": Refused("chat", {"prediction": {"type": "content", "content": "x"}},
                                                "prediction"),
    "ChatCompletionRequest.web_search_options": Refused("chat", {"web_search_options": {}}, "web_search_options"),
    "ChatCompletionRequest.include_reasoning": Holds(
        "chat", {"chat_template_kwargs": {"thinking": True}, "include_reasoning": False},
        lambda o, _: o.choices[0]["message"]["reasoning_content"] is None),
    "ChatCompletionRequest.add_generation_prompt": Holds("chat", {"add_generation_prompt": False}, lambda o, b: (
        o.body["usage"]["prompt_tokens"] < b.body["usage"]["prompt_tokens"])),
    "ChatCompletionRequest.add_special_tokens": Passed("chat", {"add_special_tokens": True},
                                                       lambda o: o.encodes == [True]),
    "ChatCompletionRequest.chat_template_kwargs": Holds(
        "chat", {"chat_template_kwargs": {"thinking": True}},
        lambda o, b: o.choices[0]["message"]["reasoning_content"] == b.text()),
    # -- nested: output constraints ---------------------------------------------------------------
    "StructuredOutputsRequest.json_schema": Holds("completions", {"structured_outputs": {"json": SCHEMA},
                                                                  "max_tokens": 3}, _json_start),
    "StructuredOutputsRequest.regex": Holds("completions", {"structured_outputs": {"regex": "[cd]{2}"}},
                                            _matches("[cd]{2}")),
    "StructuredOutputsRequest.choice": Holds("completions", {"structured_outputs": {"choice": ["up", "down"]}},
                                             _matches("up|down")),
    "StructuredOutputsRequest.grammar": Holds("completions", {"structured_outputs": {"grammar": 'root ::= "ab"'}},
                                              _matches("ab")),
    "StructuredOutputsRequest.json_object": Holds("completions", {"structured_outputs": {"json_object": True},
                                                                  "max_tokens": 3}, _json_start),
    "StructuredOutputsRequest.structural_tag": Holds("completions", {"structured_outputs": {"structural_tag": {
        "type": "structural_tag", "format": {"type": "const_string", "value": "hello"}}}}, _matches("hello")),
    "StructuredOutputsRequest.disable_any_whitespace": Holds(
        "completions", {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}, "max_tokens": 12,
                        "ignore_eos": False},
        lambda o, _: o.text() in ('{"ok": true}', '{"ok": false}', '{"ok":true}', '{"ok":false}')),
    "ResponseFormat.type": Holds("chat", {"response_format": {"type": "json_object"}, "max_tokens": 3},
                                 _json_start),
    "ResponseFormat.json_schema": Holds("chat", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": SCHEMA}}, "max_tokens": 3}, _json_start),
    "JsonSchemaFormat.json_schema": Holds("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "schema": SCHEMA}}, "max_tokens": 3}, _json_start),
    **{f"JsonSchemaFormat.{name}": NoOp(
        "completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA, name: value}}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}})
       for name, value in (("name", "answer"), ("description", "a yes/no answer"), ("strict", False))},
    "StreamOptions.include_usage": Holds("chat", {"stream": True, "stream_options": {"include_usage": True}},
                                         _streams_usage),
    # -- nested: tools ------------------------------------------------------------------------------
    "ChatCompletionTool.type": Refused("chat", {"tools": [{**TOOLS[0], "type": "code_interpreter"}]}, "tools"),
    "ChatCompletionTool.function": Differs("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]},
                                           {"tools": TOOLS}),
    "FunctionDefinition.name": Differs("chat", {"tools": [{"type": "function", "function": {
        **TOOLS[0]["function"], "name": "get_forecast"}}]}, {"tools": TOOLS}),
    "FunctionDefinition.description": Differs("chat", {"tools": [{"type": "function", "function": {
        **TOOLS[0]["function"], "description": "Rain or shine"}}]}, {"tools": TOOLS}),
    "FunctionDefinition.parameters": Differs("chat", {"tools": [{"type": "function", "function": {
        **TOOLS[0]["function"], "parameters": SCHEMA}}]}, {"tools": TOOLS}),
    "FunctionDefinition.strict": NoOp("chat", {"tools": [{"type": "function", "function": {
        **TOOLS[0]["function"], "strict": True}}]}, {"tools": TOOLS}),
    # A forced call starts with the calls block and the named function's header.
    **{key: Holds("chat", {"tools": TOOLS + [{"type": "function", "function": {"name": "add"}}],
                           "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                           "max_tokens": 64},
                  lambda o, _: (CALL_BEGIN + "get_weather") in (o.choices[0]["message"]["content"] or ""))
       for key in ("NamedToolChoice.function", "NamedFunction.name")},
    "NamedToolChoice.type": Refused("chat", {"tools": TOOLS, "tool_choice": {
        "type": "code_interpreter", "function": {"name": "get_weather"}}}, "tool_choice"),
    # -- nested: messages ---------------------------------------------------------------------------
    "ChatMessage.role": Differs("chat", {"messages": [{"role": "system", "content": "What is a list?"}]}),
    "ChatMessage.content": Differs("chat", {"messages": [{"role": "user", "content": "What is a dict?"}]}),
    "ChatMessage.name": Passed("chat", {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]},
                               _in_messages("ann", lambda m: m.get("name"))),
    "ChatMessage.tool_calls": Differs("chat", {"messages": TOOL_TURN},
                                      {"messages": [TOOL_TURN[0], {"role": "assistant", "content": None},
                                                    TOOL_TURN[2]]}),
    "ChatMessage.tool_call_id": Passed("chat", {"messages": TOOL_TURN},
                                       _in_messages("call_1", lambda m: m.get("tool_call_id"))),
    "ChatMessage.reasoning_content": Passed(
        "chat", {"messages": [TOOL_TURN[0], {"role": "assistant", "content": "ok", "reasoning_content": "hmm"},
                              {"role": "user", "content": "and?"}]},
        _in_messages("hmm", lambda m: m.get("reasoning_content"))),
    "ToolCallIn.id": Passed("chat", {"messages": TOOL_TURN},
                            _in_messages("call_1", lambda m: (m.get("tool_calls") or [{}])[0].get("id"))),
    "ToolCallIn.type": Refused("chat", {"messages": [TOOL_TURN[0], {**ASSISTANT_CALL, "tool_calls": [
        {**ASSISTANT_CALL["tool_calls"][0], "type": "code"}]}]}, "messages"),
    "ToolCallIn.function": Differs("chat", {"messages": [TOOL_TURN[0], {**ASSISTANT_CALL, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}, TOOL_TURN[2]]},
                                   {"messages": TOOL_TURN}),
    "FunctionCallIn.name": Differs("chat", {"messages": [TOOL_TURN[0], {**ASSISTANT_CALL, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_forecast", "arguments": '{"city": "Paris"}'}}
    ]}, TOOL_TURN[2]]}, {"messages": TOOL_TURN}),
    "FunctionCallIn.arguments": Differs("chat", {"messages": [TOOL_TURN[0], {**ASSISTANT_CALL, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    ]}, TOOL_TURN[2]]}, {"messages": TOOL_TURN}),
    "ContentPart.type": Refused("chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages"),
    "ContentPart.text": Differs("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is a"}, {"type": "text", "text": "set?"}]}]}),
}


def _request_models() -> list[type[BaseModel]]:
    """The request models and every model their fields hold, in order of discovery."""
    seen: list[type[BaseModel]] = []
    todo: list[type[BaseModel]] = [CompletionRequest, ChatCompletionRequest]
    while todo:
        model = todo.pop(0)
        if model in seen:
            continue
        seen.append(model)
        for info in model.model_fields.values():
            stack = [info.annotation]
            while stack:
                a = stack.pop()
                if isinstance(a, type) and issubclass(a, BaseModel):
                    todo.append(a)
                stack += list(typing.get_args(a))
    return seen


ALL_FIELDS = [f"{m.__name__}.{name}" for m in _request_models() for name in m.model_fields]


def test_every_field_has_a_case():
    missing = [key for key in ALL_FIELDS if key not in CASES]
    assert not missing, f"request fields with no case (honour, refuse or document them): {missing}"
    assert not set(CASES) - set(ALL_FIELDS), "cases for fields that no longer exist"
    # The documented lists and the cases agree.
    assert {k for k, c in CASES.items() if isinstance(c, NoOp)} == set(NO_OP_FIELDS)
    assert {k for k, c in CASES.items() if isinstance(c, Passed)} == set(PASSTHROUGH_FIELDS)
    assert set(REFUSED_FIELDS) <= {k for k, c in CASES.items() if isinstance(c, Refused)}


@pytest.fixture(scope="module")
def server(engine: Engine):
    with serve(engine, tool_call_parser="deepseek_v31", enable_auto_tool_choice=True,
               reasoning_parser="deepseek_v3") as s:
        yield s


_BASES: dict[str, Outcome] = {}


def _base(server, route, extra, monkeypatch) -> Outcome:
    body = {**BASE[route], **extra}
    key = json.dumps(body, sort_keys=True)
    if key not in _BASES:
        _BASES[key] = _run(server, route, body, monkeypatch)
        assert _BASES[key].status == 200, _BASES[key].body
    return _BASES[key]


@pytest.mark.parametrize("key", ALL_FIELDS)
def test_field(server, monkeypatch, key):
    case = CASES[key]
    route = case.route
    if isinstance(case, Refused):
        out = _run(server, route, {**BASE[route], **case.body}, monkeypatch)
        assert out.status == 400, out.body
        assert (out.body["error"]["param"] or "").startswith(case.param), out.body
        if key in REFUSED_FIELDS:
            assert REFUSED_FIELDS[key].split(";")[0] in out.body["error"]["message"]
        return
    if isinstance(case, Passed):
        out = _run(server, route, {**BASE[route], **case.body}, monkeypatch)
        assert out.status == 200 and case.check(out), (out.templates, out.encodes)
        return
    base = _base(server, route, getattr(case, "base", {}), monkeypatch)
    body = case.body(base) if callable(case.body) else case.body
    out = _run(server, route, {**BASE[route], **getattr(case, "base", {}), **body}, monkeypatch)
    if isinstance(case, Differs):
        assert out.status == 200 and out.key() != base.key(), out.body
    elif isinstance(case, NoOp):
        assert out.key() == base.key(), (out.body, base.body)
    else:
        assert out.status in (200, 404) and case.check(out, base), out.body or out.events


def test_completions_response_format_is_json(server, monkeypatch):
    """The bug this policy closes: /v1/completions honours response_format like chat. (The
    random model pads JSON with whitespace until max_tokens, so the document is closed
    here by hand: everything it wrote is the schema's document up to the last brace.)"""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 40, "seed": 5}
    plain = _run(server, "completions", body, monkeypatch)
    assert not plain.text().lstrip().startswith("{")
    out = _run(server, "completions", {**body, "response_format": fmt}, monkeypatch)
    assert out.status == 200 and out.choices[0]["finish_reason"] == "length"
    assert json.loads(out.text() + "}") in ({"ok": True}, {"ok": False})
    both = _run(server, "completions", {"model": MODEL, "prompt": "x", "response_format": fmt,
                                        "guided_regex": "a"}, monkeypatch)
    assert both.status == 400 and both.body["error"]["param"] == "guided_regex"
    assert "response_format and guided_regex" in both.body["error"]["message"]


def test_unknown_fields_are_ignored_with_a_warning(server, monkeypatch, caplog):
    with caplog.at_level("WARNING", logger="deepinfer.entrypoints.openai.api_server"):
        out = _run(server, "chat", {**BASE["chat"], "store": True, "stream_options": None,
                                    "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi",
                                                                               "cache_control": {}}]}]},
                   monkeypatch)
    assert out.status == 200
    assert "ignoring request fields this server does not know: messages[0].content[0].cache_control, store" \
        in caplog.text
