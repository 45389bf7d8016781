"""Forced tool calls in DeepSeek's DSML formats through the openai SDK over the embedded
tiny model. Started as `deepinfer serve` without --tool-call-parser, the server reads
and forces DeepSeek-V4.1's DSML (`<｜DSML｜ calls>`: the model is a V4.1 checkpoint);
with `--tool-call-parser deepseek_v32`, V3.2's. The random weights never write a call on
their own; the grammar makes them write valid ones (about 170 byte-level tokens a call
here)."""

from __future__ import annotations

import json

import httpx2
import jsonschema
import openai
import pytest

from deepinfer.engine.engine import Engine
from tests.server.conftest import MODEL, RunningServer, serve
from tests.server.test_tool_calling import MESSAGES, NAMED, SCHEMAS, TOOLS, _streamed_calls


@pytest.fixture(scope="module")
def server(engine: Engine):
    with serve(engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_embedded_model_gets_v41_dsml(server):
    assert server.app.state.server_state.tool_format.name == "deepseek_v41"


@pytest.mark.parametrize("tool_choice, stream", [("required", False), (NAMED, True)])
def test_forced_dsml_calls(client, tool_choice, stream):
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, seed=2, max_tokens=600,
                  parallel_tool_calls=False)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        calls, finishes = _streamed_calls(chunks)
        assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}
        assert sum(len(c.choices[0].delta.tool_calls or []) for c in chunks if c.choices) > 2   # in pieces
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(calls) == 1
    call_id, name, arguments = calls[0]
    assert call_id.startswith("call_") and name in SCHEMAS
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if tool_choice == NAMED:
        assert name == "get_weather"


@pytest.fixture(scope="module")
def v32_server(engine: Engine):
    with serve(engine, tool_call_parser="deepseek_v32", enable_auto_tool_choice=True) as s:
        yield s


def test_v32_calls_and_their_results_in_the_next_prompt(v32_server):
    """Parallel forced calls streamed; then the conversation with the calls and their
    results, rendered in V3.2's layout, goes back for an answer."""
    client = openai.OpenAI(base_url=v32_server.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, stream=True,
                                                 tool_choice="required", seed=5, max_tokens=800))
    calls, finishes = _streamed_calls(chunks)
    assert finishes[-1] == "tool_calls" and calls
    for _, name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls]}
    results = [{"role": "tool", "tool_call_id": i, "content": f"result {k}"} for k, (i, _, _) in enumerate(calls)]
    conversation = MESSAGES + [assistant] + results
    with httpx2.Client(timeout=30) as http:
        ids = http.post(v32_server.url + "/tokenize", json={"messages": conversation}).json()["tokens"]
        prompt = http.post(v32_server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert f'\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="{calls[0][1]}">\n<｜DSML｜parameter name="' in prompt
    assert "<function_results>\n<result>result 0</result>" in prompt
    assert f"<result>result {len(calls) - 1}</result>\n</function_results>" in prompt
    final = client.chat.completions.create(model=MODEL, messages=conversation, tools=TOOLS, tool_choice="auto",
                                           seed=5, max_tokens=4)
    assert final.choices[0].finish_reason == "length" and final.choices[0].message.tool_calls is None
