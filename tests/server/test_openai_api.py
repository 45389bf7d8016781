"""The OpenAI-compatible server through the official openai SDK: completions and
chat (streamed and not), sampling features, errors, tokenizer routes, metrics."""

from __future__ import annotations

import json
import re

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.engine.engine import Engine
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler.plan import PLACEHOLDER_TOKEN_ID
from tests.server.conftest import API_KEY, MODEL, RunningServer, generate_direct, serve

PROMPT = "Return a new dictionary with keys from iterable and values set to value."
MESSAGES = [{"role": "user", "content": "What is a list?"}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(engine: Engine):
    with serve(engine, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def sse_events(server: RunningServer, path: str, body: dict) -> list[str]:
    with httpx2.Client(timeout=30) as http:
        resp = http.post(server.url + path, json=body, headers=AUTH)
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        return [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]


# -- completions -------------------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx2.get(server.url + "/health").status_code == 200   # no key needed


def test_completion_equals_engine(server, client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    ref = generate_direct(server, PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert resp.choices[0].text == ref.outputs[0].text and resp.choices[0].finish_reason == "length"
    assert resp.object == "text_completion" and resp.model == MODEL
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert server.pool_is_full()


def test_stream_equals_whole(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_and_seeds(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, n=3,
                  extra_body={"ignore_eos": True})
    a = client.completions.create(seed=7, **kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.text for c in a.choices]
    assert len(set(texts)) == 3
    assert a.usage.completion_tokens == 30
    assert [c.text for c in client.completions.create(seed=7, **kwargs).choices] == texts
    assert [c.text for c in client.completions.create(seed=8, **kwargs).choices] != texts
    # n > 1 streamed: every choice's deltas add up to the same texts.
    parts = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(seed=7, stream=True, **kwargs):
        for c in chunk.choices:
            parts[c.index] += c.text
    assert [parts[i] for i in range(3)] == texts


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[6:10]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.finish_reason == "stop" and out.text == base[:base.index(stop)]
    assert out.model_extra["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == out.text


def test_logprobs_and_echo(client, server):
    # Logprob tokens show special tokens, so compare with text that keeps them too.
    raw = {"ignore_eos": True, "skip_special_tokens": False}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                    extra_body=raw).choices[0]
    lp = out.logprobs
    assert "".join(lp.tokens) == out.text and len(lp.token_logprobs) == 6
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and top[tok] == tok_lp
        assert tok_lp == max(top.values())   # greedy picks the most likely token
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                       extra_body=raw).choices[0]
    assert echoed.text == PROMPT + out.text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=True, stream=True,
        extra_body=raw) if c.choices)
    assert streamed == PROMPT + out.text


def test_prompt_forms(server, client):
    ids = server.engine.tokenizer.encode(PROMPT)
    kwargs = dict(model=MODEL, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(prompt=PROMPT, **kwargs).choices[0].text
    assert client.completions.create(prompt=ids, **kwargs).choices[0].text == text
    many = client.completions.create(prompt=[ids, ids[:5], ids], n=2, **kwargs)
    assert [c.index for c in many.choices] == list(range(6))
    assert [c.text for c in many.choices][:2] == [text, text] and many.choices[4].text == text
    assert many.usage.prompt_tokens == 2 * len(ids) + 5
    strings = client.completions.create(prompt=[PROMPT, "x"], **kwargs)
    assert strings.choices[0].text == text and len(strings.choices) == 2


# -- chat ------------------------------------------------------------------------------------------
def test_chat_whole_stream_and_logprobs(server, client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **kwargs)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == 10 and "".join(t.token for t in content) == choice.message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].token == t.token   # greedy
        assert bytes(t.bytes).decode() == t.token
    rendered = server.engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = server.engine.tokenizer.encode(rendered, add_special_tokens=False)
    assert whole.usage.prompt_tokens == len(ids)
    ref = generate_direct(server, ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert choice.message.content == ref.outputs[0].text

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_chat_max_completion_tokens_and_n(client):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3, n=2,
                                          seed=1, extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 6


def test_structured_outputs(client):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body={
        "structured_outputs": {"regex": "[ab]{3}"}, "ignore_eos": True})
    assert re.fullmatch("[ab]{3}", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    picked = client.completions.create(model=MODEL, prompt="x", max_tokens=8, n=3, seed=3, extra_body={
        "structured_outputs": {"choice": ["yes", "no"]}})
    assert {c.text for c in picked.choices} <= {"yes", "no"}
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, response_format=fmt)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
                stream=True, **kwargs) if c.choices)
        else:
            text = client.chat.completions.create(**kwargs).choices[0].message.content
        assert text.lstrip().startswith("{")     # constrained from the first token on
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            continue      # ran out of max_tokens inside the document
        assert set(value) == {"x"} and isinstance(value["x"], int)
    obj = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.lstrip()[:1] in ("{", "[")


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"bogus": 1}}, "structured_outputs.bogus"),
])
def test_bad_structured_outputs_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=body)
    assert info.value.param == param


def test_bad_response_format_is_400(client):
    for fmt in ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "no-such-type"}}},
                {"type": "json_schema", "json_schema": {"name": "s"}},
                {"type": "xml"}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt)
        assert info.value.param.startswith("response_format")
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": {"regex": "a"}})


# -- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"),
    (dict(n=1000), "n"),
    (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(logit_bias={"abc": 1}), "logit_bias"),
    (dict(logit_bias={"5000": 1}), "logit_bias"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(extra_body={"min_p": 1.5}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0.0}), "repetition_penalty"),
    (dict(extra_body={"min_tokens": 20}, max_tokens=4), "min_tokens"),
    (dict(extra_body={"stop_token_ids": [10**6]}), "stop_token_ids"),
    (dict(best_of=3), "best_of"),
    (dict(suffix="x"), "suffix"),
])
def test_bad_parameters_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", **{"max_tokens": 4, **kwargs})
    err = info.value
    assert err.status_code == 400 and err.param == param and err.type == "invalid_request_error"


def test_auto_tool_choice_needs_the_server_flags(client):
    tools = [{"type": "function", "function": {"name": "f"}}]
    for kwargs in (dict(tools=tools), dict(tools=tools, tool_choice="auto")):
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice") as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **kwargs)
        assert info.value.param == "tool_choice"
    # "none" needs no flag: the model gets no tools.
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, tools=tools,
                                          tool_choice="none")
    assert resp.choices[0].message.tool_calls is None


def test_bad_chat_parameters_are_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True, top_logprobs=30)
    assert info.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])


def test_bad_prompts_are_400(server, client):
    vocab = server.engine.config.model.vocab_size
    max_len = server.engine.config.model.max_model_len
    cases = [("", "empty"), ([], "empty"), ([[]], "empty"), ([1, vocab + 3], "out of range"),
             ([[5, 6], [-1]], "out of range")]
    for prompt, words in cases:
        with pytest.raises(openai.BadRequestError, match=words) as info:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert info.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[5] * (max_len - 2), max_tokens=4)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    # No max_tokens: the prompt alone leaves no room (the engine's own fit check).
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=[5] * max_len, max_tokens=None)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * max_len}],
                                       max_completion_tokens=4)
    assert server.pool_is_full()


def test_validation_errors_are_400_in_openai_shape(server):
    with httpx2.Client(timeout=30, headers=AUTH) as http:
        for body in ['{"prompt": ', '[1, 2]', '{"model": "tiny-model"}',
                     '{"prompt": "x", "max_tokens": "many"}',
                     '{"prompt": {"a": 1}}', '{"prompt": "x", "stream_options": {"include_usage": "maybe"}}']:
            resp = http.post(server.url + "/v1/completions", content=body,
                             headers={"Content-Type": "application/json"})
            assert resp.status_code == 400, body
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400
        resp = http.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": "many"})
        assert resp.json()["error"]["param"] == "max_tokens"
        resp = http.get(server.url + "/v1/no-such-route")
        assert resp.status_code == 404 and "error" in resp.json()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert info.value.code == "model_not_found" and info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)


def test_api_key_required_everywhere_but_health(server):
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    paths = set(server.app.openapi()["paths"]) | {"/openapi.json", "/docs", "/no-such-route"}
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/metrics"} <= paths
    with httpx2.Client(timeout=30) as http:
        for path in sorted(paths - {"/health"}):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                for method in ("GET", "POST"):
                    resp = http.request(method, server.url + path, headers=headers, json={})
                    assert resp.status_code == 401, (method, path, headers)
                    assert resp.json()["error"]["code"] == "invalid_api_key"
        assert http.get(server.url + "/health").status_code == 200
        assert http.get(server.url + "/openapi.json", headers=AUTH).status_code == 200


# -- tokenizer routes ----------------------------------------------------------------------------------
def test_tokenize_detokenize(server):
    tok = server.engine.tokenizer
    with httpx2.Client(timeout=30, headers=AUTH) as http:
        r = http.post(server.url + "/tokenize", json={"model": MODEL, "prompt": PROMPT,
                                                      "return_token_strs": True}).json()
        assert r["tokens"] == tok.encode(PROMPT) and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == server.engine.config.model.max_model_len
        assert "".join(r["token_strs"]) == PROMPT and r["token_strs"][0] == tok.decode(r["tokens"][:1])
        chat = http.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
        rendered = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
        assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False) and chat["token_strs"] is None
        d = http.post(server.url + "/detokenize", json={"model": MODEL, "tokens": r["tokens"]})
        assert d.status_code == 200 and d.json() == {"prompt": PROMPT}
        bad = http.post(server.url + "/detokenize", json={"tokens": [1, 10**7]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert http.post(server.url + "/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404


# -- failures ------------------------------------------------------------------------------------------
def test_failure_mid_stream_sends_error_then_done(server, client):
    # The fault hits the first launch of a sequence that has two sampled tokens already: by
    # then both have been streamed (a step lands the previous one after launching the next).
    # Keyed on the request's own tokens, not on a launch count, which another request's
    # steps (or bookkeeping) could advance.
    server.wait_idle()
    runner = server.engine.runner
    real = runner.launch

    def sampled(req_id: str) -> int:
        state = runner.requests.get(req_id)
        return 0 if state is None else sum(t != PLACEHOLDER_TOKEN_ID for t in state.output_token_ids)

    def flaky(plan):
        if any(sampled(seq.req_id) >= 2 for seq in plan.seqs):
            raise RuntimeError("injected device fault")
        return real(plan)

    runner.launch = flaky
    try:
        events = sse_events(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "stream": True,
                                                        "ignore_eos": True})
    finally:
        runner.launch = real
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "injected device fault" in error["message"] and error["code"] == 500
    assert any(json.loads(e).get("choices") for e in events[:-2])     # some text came first
    # The SDK surfaces the in-band error; the server keeps serving.
    runner.launch = flaky
    try:
        with pytest.raises(openai.APIError, match="injected"):
            for _ in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stream=True,
                                               extra_body={"ignore_eos": True}):
                pass
    finally:
        runner.launch = real
    # Not streamed: a 500 in OpenAI's shape.
    runner.launch = flaky
    try:
        with pytest.raises(openai.InternalServerError, match="injected") as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20,
                                      extra_body={"ignore_eos": True})
    finally:
        runner.launch = real
    assert info.value.status_code == 500
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens <= 3
    assert server.pool_is_full()


# -- metrics -------------------------------------------------------------------------------------------
def _scrape(server: RunningServer) -> dict[str, float]:
    text = httpx2.get(server.url + "/metrics", headers=AUTH).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") == MODEL and "le" not in sample.labels:
                key = sample.name
                if "finished_reason" in sample.labels:
                    key += ":" + sample.labels["finished_reason"]
                values[key] = sample.value
    return values


def test_metrics_after_traffic(server, client):
    before = _scrape(server)
    for _ in range(2):   # the second round hits the prefix cache
        client.completions.create(model=MODEL, prompt=PROMPT * 12, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                   extra_body={"ignore_eos": True})
    after = _scrape(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    prompt_len = len(server.engine.tokenizer.encode(PROMPT * 12))
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 2 * 4 + 3
    assert delta("vllm:generation_tokens_total") == 14
    assert delta("vllm:prompt_tokens_total") >= 2 * prompt_len
    assert delta("vllm:request_success_total:length") == 3
    assert delta("vllm:prefix_cache_queries_total") >= 2 * prompt_len
    assert delta("vllm:prefix_cache_hits_total") >= 16
    assert delta("vllm:time_to_first_token_seconds_sum") > 0
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert "vllm:num_preemptions_total" in after


def test_usage_reports_cached_prompt_tokens(server, client):
    """``usage.prompt_tokens_details.cached_tokens`` in every response: 0 on a miss, the prefix
    cache's hit (a multiple of 16 tokens) when the prompt's start was seen before."""
    system = "You are a helpful assistant who answers questions about Python lists. " * 6
    prompt = system + "What does append do?"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=system + "And pop?", max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit > 0 and hit % 16 == 0 and hit < again.usage.prompt_tokens
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens > 0
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is a list?"}]
    chat = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
            for _ in range(2)]
    assert chat[1].usage.prompt_tokens_details.cached_tokens > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chat[1].usage.prompt_tokens_details.cached_tokens
    # The stream opens with the assistant role once the first output exists.
    assert chunks[0].choices[0].delta.role == "assistant"
