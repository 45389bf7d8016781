"""``deepinfer bench serve --dataset-name multiturn`` without a model: the conversations'
texts, their sending (each turn carries the history with the answers the server gave), and
the prefix-hit and per-turn accounting."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from deepinfer.bench.serve import conversations, http_client, metrics, workload
from deepinfer.bench.serve.endpoint import RequestResult
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.entrypoints.llm import DEFAULT_MODEL


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL)


def test_conversation_texts(tokenizer):
    work = workload.sample_multiturn(tokenizer, conversations=3, turns=2, system_len=40, question_len=12,
                                     output_len=5, seed=1)
    assert work == workload.sample_multiturn(tokenizer, conversations=3, turns=2, system_len=40, question_len=12,
                                             output_len=5, seed=1)
    count = lambda t: len(tokenizer.encode(t, add_special_tokens=False))   # noqa: E731
    assert 36 <= count(work.system) <= 40
    assert len(work.questions) == 3 and all(len(q) == 2 for q in work.questions)
    assert all(8 <= count(q) <= 12 for conv in work.questions for q in conv)
    assert len({q for conv in work.questions for q in conv}) == 6 and work.output_len == 5
    assert workload.sample_multiturn(tokenizer, conversations=1, turns=1, system_len=0, question_len=4,
                                     output_len=1).system == ""
    with pytest.raises(ValueError, match="--multiturn-turns must be >= 1"):
        workload.sample_multiturn(tokenizer, conversations=1, turns=0, system_len=4, question_len=4, output_len=1)


def test_each_turn_sends_the_history_with_the_answers():
    seen: list[dict] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        n = len(body["messages"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': f'A{n}'}}]})}\n\n"
                         .encode())
        usage = {"prompt_tokens": 10 * n, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 5 * n}}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def run() -> tuple[list[RequestResult], list[int]]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/chat/completions"
        work = workload.Conversations("SYS", [["q00", "q01", "q02"], ["q10", "q11", "q12"]], 3)
        try:
            async with http_client.session(30) as session:
                return await conversations.run_conversations(session, url, {}, "m", work, [0.0, 0.0],
                                                             ignore_eos=True, extra_body={"seed": 1},
                                                             max_concurrency=None)
        finally:
            await runner.cleanup()

    results, turns = asyncio.run(asyncio.wait_for(run(), 30))
    assert sorted(turns) == [0, 0, 1, 1, 2, 2] and all(r.success for r in results)
    last = [b for b in seen if b["messages"][-1]["content"] == "q12"][0]
    assert last["messages"] == [{"role": "system", "content": "SYS"}, {"role": "user", "content": "q10"},
                                {"role": "assistant", "content": "A2"}, {"role": "user", "content": "q11"},
                                {"role": "assistant", "content": "A4"}, {"role": "user", "content": "q12"}]
    assert last["max_completion_tokens"] == 3 and last["ignore_eos"] and last["seed"] == 1 and last["stream"]
    figures = metrics.multiturn_metrics(results, turns)
    # Prompts of 2, 4, 6 messages: 20 + 40 + 60 tokens a conversation, half of them cached.
    assert figures["total_cached_tokens"] == 120 and figures["prefix_hit_rate"] == pytest.approx(0.5)
    assert len(figures["mean_ttft_ms_per_turn"]) == 3
    assert "Prefix-cache hit rate:                   50.0%" in metrics.format_multiturn(figures)


def test_hit_rate_needs_every_server_to_report_cached_tokens():
    a = RequestResult(success=True, ttft=0.1, prompt_len=10, output_tokens=1, cached_tokens=4)
    b = RequestResult(success=True, ttft=0.3, prompt_len=10, output_tokens=1)
    failed = RequestResult(success=False, prompt_len=50, cached_tokens=50)
    assert metrics.multiturn_metrics([a, failed], [0, 1])["prefix_hit_rate"] == pytest.approx(0.4)
    figures = metrics.multiturn_metrics([a, b], [1, 1])
    assert figures["prefix_hit_rate"] is None and figures["mean_ttft_ms_per_turn"] == pytest.approx([200.0])
