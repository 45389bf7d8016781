"""Tool calling and reasoning on /v1/chat/completions through the openai SDK, on a
server started as `deepinfer serve --tool-call-parser deepseek_v31
--enable-auto-tool-choice --reasoning-parser deepseek_v3` over the embedded tiny
model. Its chat template has no tool support, so tools reach it in DeepSeek's format;
its random weights never write a call on their own, so forced calls show the grammar
at work (the markers cost about 110 byte-level tokens a call here)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from deepinfer.engine.engine import Engine
from tests.server.conftest import MODEL, RunningServer, serve

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather of a city",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                       "required": ["a"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(engine: Engine):
    with serve(engine, tool_call_parser="deepseek_v31", enable_auto_tool_choice=True,
               reasoning_parser="deepseek_v3") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _check_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _streamed_calls(chunks) -> tuple[list[tuple[str, str, str]], list]:
    """(id, name, arguments) of each streamed call, checking the delta shapes on the way,
    and the finish reasons."""
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert all(not d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for piece in (t for d in deltas for t in (d.tool_calls or [])):
        if piece.index not in calls:      # a call's first delta: id, type and name
            assert piece.id.startswith("call_") and piece.type == "function" and piece.function.name
            calls[piece.index] = [piece.id, piece.function.name, piece.function.arguments or ""]
        else:                             # then argument fragments only
            assert piece.id is None and piece.function.name is None
            calls[piece.index][2] += piece.function.arguments
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in sorted(calls)], [c.choices[0].finish_reason for c in chunks if c.choices]


@pytest.mark.parametrize("tool_choice, stream", [("required", False), ("required", True), (NAMED, True)])
def test_forced_calls(client, tool_choice, stream):
    """The grammar makes even the random model write valid calls: a calls block of calls
    to the given functions, arguments that satisfy their schemas."""
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, seed=2, max_tokens=400)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        calls, finishes = _streamed_calls(chunks)
        assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
        assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices) > 2   # in pieces
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert all(c.type == "function" for c in choice.message.tool_calls)
    assert calls and len({c[0] for c in calls}) == len(calls)
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_")
        _check_call(name, arguments)
    if tool_choice == NAMED:
        assert {name for _, name, _ in calls} == {"get_weather"}


def test_agent_loop(client):
    """A named call, its result back in the conversation as a tool message, a final answer."""
    first = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=NAMED,
                                           parallel_tool_calls=False, seed=1, max_tokens=400)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    _check_call(call.function.name, call.function.arguments)
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"weather": "sunny, 21 C"})}
    conversation = MESSAGES + [choice.message.model_dump(exclude_none=True), result]
    final = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, tool_choice="auto",
                                           seed=1, max_tokens=8)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.finish_reason == "length"
    assert isinstance(answer.message.content, str) and answer.message.content
    # The call and the tool output are in the prompt (DeepSeek's format): it grew by more than them.
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_auto_and_none_give_content(client):
    for choice in ("auto", "none"):
        resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                              seed=3, max_tokens=6)
        message = resp.choices[0].message
        assert message.tool_calls is None and message.content and resp.choices[0].finish_reason == "length"
    # "none" sends no tools: the prompt lacks the tool section "auto" has.
    with_tools = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=1)
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                             max_tokens=1)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert without.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice",
     "get_time"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools[2].function.name", "defined twice"),
    (dict(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools[0].function.name",
     "1 to 64"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "integer",
                                                                                "not": {"const": 1}}}}],
          tool_choice="required"), "tools[0].function.parameters", 'keyword "not"'),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
          tool_choice="required"), "tools[0].function.parameters", 'must describe a JSON object'),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "both constrain"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools.0.type", "function"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", "none"),
])
def test_bad_tool_requests_are_400(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError, match=words) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
    assert info.value.param is not None and info.value.param.startswith(param)


def test_reasoning_split(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, seed=4, max_tokens=12)
    off = client.chat.completions.create(**kwargs).choices[0].message
    assert off.model_extra["reasoning_content"] is None and off.content
    thinking = {"chat_template_kwargs": {"thinking": True}}
    on = client.chat.completions.create(extra_body=thinking, **kwargs).choices[0].message
    # The random model never closes its reasoning block: the whole output is reasoning.
    assert on.model_extra["reasoning_content"] == off.content and on.content is None
    streamed = list(client.chat.completions.create(stream=True, extra_body=thinking, **kwargs))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == off.content
    assert not "".join(d.content or "" for d in deltas)
    hidden = client.chat.completions.create(extra_body={**thinking, "include_reasoning": False},
                                            **kwargs).choices[0].message
    assert hidden.model_extra["reasoning_content"] is None and hidden.content is None
    enable = client.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": True}},
                                            **kwargs).choices[0].message
    assert enable.model_extra["reasoning_content"] == off.content
