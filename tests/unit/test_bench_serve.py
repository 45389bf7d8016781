"""``deepinfer bench serve`` without a model: metric math on synthetic timings, the
workload and arrival schedule, and the HTTP client (aiohttp) against scripted HTTP
servers: server-sent events however their bytes are split, streamed requests (chunked
events, errors, refusals, timeouts), the connection pool, and the message when aiohttp
is missing."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

import numpy as np
import pytest

import deepinfer
from deepinfer.bench.serve import endpoint, http_client, metrics, workload
from deepinfer.bench.serve.endpoint import RequestResult
from deepinfer.bench.serve.workload import SampleRequest
from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.entrypoints.cli import main as cli_main
from deepinfer.entrypoints.llm import DEFAULT_MODEL


def ok(start: float, ttft: float, itl: list[float], tokens: int, prompt_len: int = 10) -> RequestResult:
    return RequestResult(success=True, start_time=start, ttft=ttft, itl=itl, latency=ttft + sum(itl),
                         output_tokens=tokens, prompt_len=prompt_len)


def compute(results: list[RequestResult], duration: float = 2.0, **kw) -> dict:
    kw = {"percentile_metrics": ["ttft", "tpot", "itl", "e2el"], "percentiles": [50, 90, 99],
          "goodput": {}} | kw
    return metrics.compute_metrics(results, duration, **kw)


# -- metric math -----------------------------------------------------------------------------------
def test_tpot_excludes_the_first_token_and_one_token_requests():
    # 11 tokens: TTFT 0.3 s, then 10 gaps of 0.05 s -> TPOT = 0.5 / 10 = 50 ms (not 0.8 / 11).
    a = ok(0.0, 0.3, [0.05] * 10, tokens=11)
    # Two events but 21 tokens (events carry several): TPOT uses tokens, not events.
    b = ok(0.1, 0.2, [0.4], tokens=21)       # (0.6 - 0.2) / 20 = 20 ms
    c = ok(0.2, 0.1, [], tokens=1)           # one token: no TPOT
    m = compute([a, b, c])
    assert metrics.tpot(a) == pytest.approx(0.05)
    assert metrics.tpot(c) is None
    assert m["mean_tpot_ms"] == pytest.approx(35.0)
    assert m["median_tpot_ms"] == pytest.approx(35.0)
    assert m["std_tpot_ms"] == pytest.approx(15.0)       # population std of (50, 20)
    # ITL pools every gap of every request: ten of 50 ms and one of 400 ms.
    assert m["mean_itl_ms"] == pytest.approx((10 * 50 + 400) / 11)
    assert m["median_itl_ms"] == pytest.approx(50.0)
    assert m["mean_e2el_ms"] == pytest.approx((800 + 600 + 100) / 3)


def test_percentiles_interpolate_linearly_and_keys_follow_vllm():
    results = [ok(0.0, t, [0.01], tokens=2) for t in (0.1, 0.2, 0.3, 0.4)]
    m = compute(results, percentiles=[50, 90, 99, 99.9])
    # ms values 100, 200, 300, 400: p90 at rank 0.9 * 3 = 2.7 -> 300 + 0.7 * 100.
    assert m["p50_ttft_ms"] == pytest.approx(250.0)
    assert m["p90_ttft_ms"] == pytest.approx(370.0)
    assert m["p99_ttft_ms"] == pytest.approx(397.0)
    assert m["p99.9_ttft_ms"] == pytest.approx(399.7)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(12500.0))
    assert "p99_itl_ms" in m and "mean_e2el_ms" in m


def test_throughputs_count_completed_requests_only():
    failed = RequestResult(success=False, error="HTTP 400", prompt_len=99, output_tokens=None)
    m = compute([ok(0.0, 0.1, [0.1] * 4, tokens=5, prompt_len=7), ok(0.0, 0.1, [0.1], tokens=2, prompt_len=3),
                 failed], duration=4.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (10, 7)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(7 / 4)
    assert m["total_token_throughput"] == pytest.approx(17 / 4)
    assert m["request_goodput"] is None
    assert metrics.per_request([failed], 0.0)["output_lens"] == [0]


def test_goodput_counts_requests_meeting_every_slo():
    fast = ok(0.0, 0.05, [0.01] * 9, tokens=10)        # TTFT 50, TPOT 10, E2EL 140 ms
    slow_first = ok(0.0, 0.5, [0.01] * 9, tokens=10)   # TTFT 500
    slow_decode = ok(0.0, 0.05, [0.1] * 9, tokens=10)  # TPOT 100, E2EL 950
    single = ok(0.0, 0.05, [], tokens=1)               # TPOT counts as 0
    results = [fast, slow_first, slow_decode, single]
    assert compute(results, goodput={"ttft": 100})["request_goodput"] == pytest.approx(3 / 2)
    assert compute(results, goodput={"ttft": 100, "tpot": 50})["request_goodput"] == pytest.approx(2 / 2)
    assert compute(results, goodput={"e2el": 140.0001})["request_goodput"] == pytest.approx(2 / 2)


def test_peaks_spread_tokens_over_events_and_sweep_concurrency():
    # a: events at 0.5, 1.5 (8 tokens -> 4 each); b: events at 0.2, 0.4, 0.6, 0.8 (4 tokens).
    a = ok(0.0, 0.5, [1.0], tokens=8)
    b = ok(0.1, 0.1, [0.2, 0.2, 0.2], tokens=4)
    c = ok(1.6, 0.1, [], tokens=1)          # starts after a ended: not concurrent with it
    m = compute([a, b, c])
    assert m["max_output_tokens_per_s"] == pytest.approx(4 + 4)     # second 0: a's first event + b
    assert m["max_concurrent_requests"] == 2


def test_empty_results_give_zeros_not_errors():
    m = compute([RequestResult(error="refused")], duration=1.0, goodput={"ttft": 10})
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0
    assert m["request_goodput"] == 0.0 and m["max_concurrent_requests"] == 0


def test_parsers_name_the_flag():
    assert metrics.parse_goodput(["ttft:100", "tpot:50", "e2el:1000"]) == {"ttft": 100, "tpot": 50, "e2el": 1000}
    for bad in (["itl:5"], ["ttft=5"], ["ttft:-1"], ["ttft:x"]):
        with pytest.raises(ValueError, match="--goodput"):
            metrics.parse_goodput(bad)
    assert metrics.parse_percentiles("50, 90,99.9") == [50, 90, 99.9]
    with pytest.raises(ValueError, match="--metric-percentiles"):
        metrics.parse_percentiles("101")
    with pytest.raises(ValueError, match="--percentile-metrics"):
        metrics.parse_percentile_metrics("ttft,latency")


def test_result_block_has_vllm_lines():
    m = compute([ok(0.0, 0.1, [0.02] * 3, tokens=4)], goodput={"ttft": 200})
    text = metrics.format_result(m, max_concurrency=4, request_rate=2.0, percentile_metrics=["ttft", "itl"],
                                 percentiles=[99])
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    assert "Successful requests:                     1         " in lines
    assert "Maximum request concurrency:             4         " in lines
    assert "Request goodput (req/s):                 0.50      " in lines
    assert "---------------Time to First Token----------------" in lines
    assert "P99 ITL (ms):                            20.00     " in lines
    assert not any("TPOT" in line for line in lines)


# -- workload ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL)


def test_random_token_prompts(tokenizer):
    reqs = workload.sample_random(tokenizer, num_prompts=50, input_len=20, output_len=10, range_ratio=0.5,
                                  prefix_len=5, seed=3)
    assert reqs == workload.sample_random(tokenizer, num_prompts=50, input_len=20, output_len=10,
                                          range_ratio=0.5, prefix_len=5, seed=3)
    assert reqs != workload.sample_random(tokenizer, num_prompts=50, input_len=20, output_len=10,
                                          range_ratio=0.5, prefix_len=5, seed=4)
    prefix = reqs[0].prompt[:5]
    special = set(tokenizer.all_special_ids)
    for r in reqs:
        assert isinstance(r.prompt, list) and r.prompt_len == len(r.prompt)
        assert 5 + 10 <= r.prompt_len <= 5 + 30 and 5 <= r.output_len <= 15
        assert r.prompt[:5] == prefix and not special & set(r.prompt)
    assert len({r.prompt_len for r in reqs}) > 5 and len({r.output_len for r in reqs}) > 5
    assert len({tuple(r.prompt[5:]) for r in reqs}) == 50
    fixed = workload.sample_random(tokenizer, num_prompts=8, input_len=20, output_len=10, seed=0)
    assert {(r.prompt_len, r.output_len) for r in fixed} == {(20, 10)}


def test_text_prompts_reencode_to_their_length(tokenizer):
    reqs = workload.sample_random(tokenizer, num_prompts=30, input_len=40, output_len=4, seed=1, as_text=True)
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
    # Decoding random ids and encoding the text again changes the length (40 ids here come back
    # as 38 to 45 tokens); cutting and extending brings every prompt back to 40.
    assert [r.prompt_len for r in reqs] == [40] * 30
    shifted = workload.sample_random(tokenizer, num_prompts=4, input_len=40, output_len=4, seed=1,
                                     as_text=True, added_special_tokens=1)
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False)) + 1 for r in shifted)


def test_workload_checks_its_arguments(tokenizer):
    kw = dict(num_prompts=2, input_len=8, output_len=4)
    for bad, flag in ((dict(range_ratio=1.0), "--random-range-ratio"), (dict(num_prompts=0), "--num-prompts"),
                      (dict(output_len=0), "--random-output-len"), (dict(input_len=0), "--random-prefix-len")):
        with pytest.raises(ValueError, match=flag):
            workload.sample_random(tokenizer, **(kw | bad))


def test_poisson_arrivals_are_seeded_with_the_asked_mean():
    times = workload.arrival_times(20001, request_rate=4.0, seed=7)
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    np.testing.assert_array_equal(times, workload.arrival_times(20001, request_rate=4.0, seed=7))
    assert not np.array_equal(times, workload.arrival_times(20001, request_rate=4.0, seed=8))
    gaps = np.diff(times)
    # Exponential gaps: mean 1/rate and std 1/rate (the mean's std over 20000 draws is 0.7%).
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)


def test_burstiness_shapes_the_gaps():
    bursty = np.diff(workload.arrival_times(20001, request_rate=10.0, burstiness=0.25, seed=0))
    even = np.diff(workload.arrival_times(20001, request_rate=10.0, burstiness=16.0, seed=0))
    # Gamma(k, 1/(rate k)): mean 1/rate, coefficient of variation 1/sqrt(k).
    assert bursty.mean() == pytest.approx(0.1, rel=0.05) and even.mean() == pytest.approx(0.1, rel=0.03)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)
    assert even.std() / even.mean() == pytest.approx(0.25, rel=0.08)
    np.testing.assert_allclose(np.diff(workload.arrival_times(5, 2.0, burstiness=math.inf)), 0.5)
    assert not workload.arrival_times(6, math.inf).any()
    with pytest.raises(ValueError, match="--request-rate"):
        workload.arrival_times(3, 0.0)
    with pytest.raises(ValueError, match="--burstiness"):
        workload.arrival_times(3, 1.0, burstiness=0.0)


# -- HTTP against scripted servers -------------------------------------------------------------------
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def scripted_server(handler: Handler) -> AsyncIterator[tuple[str, list[tuple[bytes, bytes]]]]:
    """A server on 127.0.0.1, over raw sockets: it reads each request's head and body into
    the list yielded beside its URL, leaves the connection to ``handler``, then closes it."""
    received: list[tuple[bytes, bytes]] = []

    async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            received.append((head, await reader.readexactly(length)))
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve_one, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", received


def run_against(handler: Handler, payload: dict | None = None, timeout_s: float = 10.0) -> RequestResult:
    """``endpoint.send`` of ``payload`` to a scripted server, through a session of its own."""
    body = payload or endpoint.build_payload(endpoint.COMPLETIONS, "m", SampleRequest([5, 6], 2, 3),
                                             ignore_eos=True, extra_body={})

    async def main() -> RequestResult:
        async with scripted_server(handler) as (url, received), http_client.session(timeout_s) as session:
            result = await endpoint.send(session, f"{url}/v1/completions", body, {"X-Test": "yes"}, 2)
        (head, sent), = received
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n"), head
        assert b"x-test: yes" in head.lower() and b"content-type: application/json" in head.lower()
        assert json.loads(sent) == body
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        return result
    return asyncio.run(main())


def chunk(data: str | bytes) -> bytes:
    raw = data.encode() if isinstance(data, str) else data
    return f"{len(raw):x}\r\n".encode() + raw + b"\r\n"


def event(obj: dict | str) -> bytes:
    return chunk(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n")


SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")


def test_sse_events_across_arbitrary_splits():
    stream = ('data: {"a": 1}\r\n\r\n: a comment\n\nevent: x\ndata: line1\ndata:line2\n\n'
              'data: {"t": "é漢"}\n\ndata: [DONE]').encode()
    expected = ['{"a": 1}', "line1\nline2", '{"t": "é漢"}', "[DONE]"]

    async def events(step: int) -> list[str]:
        async def handler(_, writer):
            # Each piece is an HTTP chunk of its own, sent by itself: lines, CRLFs and
            # UTF-8 characters are cut wherever the step falls.
            writer.write(SSE_HEAD)
            for i in range(0, len(stream), step):
                writer.write(chunk(stream[i:i + step]))
                await writer.drain()
                await asyncio.sleep(0.001)
            writer.write(b"0\r\n\r\n")
            await writer.drain()

        async with scripted_server(handler) as (url, _), http_client.session(10.0) as session:
            async with session.get(url) as resp:
                return [e async for e in http_client.sse_events(resp)]

    for step in (1, 2, 3, 7, len(stream)):
        assert asyncio.run(events(step)) == expected, step


def test_chat_stream_times_content_not_the_opening_role_delta():
    async def handler(_, writer):
        writer.write(SSE_HEAD + event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        await asyncio.sleep(0.2)            # "prefill"
        for piece in ("Hel", "lo", " wor"):
            writer.write(event({"choices": [{"index": 0, "delta": {"content": piece}}]}))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}))
        writer.write(event({"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": 5}}))
        writer.write(event("[DONE]") + b"0\r\n\r\n")
        await writer.drain()

    body = endpoint.build_payload(endpoint.CHAT, "m", SampleRequest("hi", 2, 5), ignore_eos=True, extra_body={})
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_completion_tokens"] == 5
    assert body["ignore_eos"] is True and body["min_tokens"] == 5
    r = run_against(handler, body)
    assert r.success, r.error
    assert r.ttft >= 0.19                   # the role delta at ~0 s is not the first token
    assert len(r.itl) == 3 and all(g >= 0.0 for g in r.itl) and r.itl[1] >= 0.04
    assert r.latency == pytest.approx(r.ttft + sum(r.itl))
    assert (r.output_tokens, r.prompt_len, r.generated_text) == (5, 17, "Hello wor")


def test_completion_stream_without_usage_leaves_counting_to_the_tokenizer():
    async def handler(_, writer):
        writer.write(SSE_HEAD + event({"choices": [{"index": 0, "text": "a"}]})
                     + event({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]})
                     + event("[DONE]") + b"0\r\n\r\n")

    r = run_against(handler)
    assert r.success and r.output_tokens is None and r.generated_text == "ab" and len(r.itl) == 1


@pytest.mark.parametrize("script, expected", [
    (b"HTTP/1.1 400 Bad Request\r\ncontent-length: 28\r\n\r\n{\"error\": {\"message\": \"no\"}}",
     "HTTP 400 Bad Request: {\"error\": {\"message\": \"no\"}}"),
    (b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 50\r\n\r\nbusy",
     "HTTP 503 Service Unavailable: (body unreadable: ClientPayloadError: Response payload is not completed"),
    (b"HTTP/1.1 301 Moved Permanently\r\nlocation: /v2/completions\r\ncontent-length: 0\r\n\r\n",
     "HTTP 301 Moved Permanently:"),
    (SSE_HEAD + event({"choices": [{"text": "a"}]}) + event({"error": {"message": "engine died"}}),
     "error event: engine died"),
    (SSE_HEAD + event({"choices": [{"text": "a"}]}) + b"0\r\n\r\n", "ended before 'data: [DONE]'"),
    # The connection closes inside the chunked body.
    (SSE_HEAD + event({"choices": [{"text": "a"}]}), "ClientPayloadError: Response payload is not completed"),
    (SSE_HEAD + event("[DONE]") + b"0\r\n\r\n", "carried no output"),
    (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: {not json}\n\n", "JSONDecodeError"),
])
def test_failures_are_results_with_their_reason(script, expected):
    async def handler(_, writer):
        writer.write(script)
        await writer.drain()

    r = run_against(handler)
    assert not r.success and expected in r.error, r.error


def test_refused_connection_and_timeouts_are_failures():
    async def send_to(url: str) -> RequestResult:
        async with http_client.session(5.0) as session:
            return await endpoint.send(session, url, {}, {}, 1)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]        # bound, not listening: connections are refused
        r = asyncio.run(send_to(f"http://127.0.0.1:{port}/v1/completions"))
    assert not r.success and r.error.startswith("ConnectionRefusedError: Cannot connect to host"), r.error

    async def silent(_, writer):
        await asyncio.sleep(5)

    async def stalls_mid_stream(_, writer):
        writer.write(SSE_HEAD + event({"choices": [{"text": "a"}]}))
        await writer.drain()
        await asyncio.sleep(5)

    # The timeout covers the whole request: waiting for the head, and reading the body.
    for handler in (silent, stalls_mid_stream):
        r = run_against(handler, timeout_s=0.3)
        assert not r.success and r.error == "no complete response within 0.3 s", r.error

    async def answers(_, writer):
        writer.write(SSE_HEAD + event({"choices": [{"text": "a"}]}) + event("[DONE]") + b"0\r\n\r\n")
        await writer.drain()

    r = run_against(answers, timeout_s=math.inf)        # --request-timeout inf: no limit
    assert r.success, r.error


def test_an_event_longer_than_aiohttp_default_line_limit():
    text = "x" * 1_000_000           # one line of ~1 MB; aiohttp's own limit is 512 KiB

    async def handler(_, writer):
        writer.write(SSE_HEAD + event({"choices": [{"text": text, "finish_reason": "length"}]})
                     + event("[DONE]") + b"0\r\n\r\n")
        await writer.drain()

    r = run_against(handler)
    assert r.success and r.generated_text == text, r.error


def test_one_session_has_every_request_in_flight_at_once():
    # More requests than aiohttp's default pool (100 connections) would let through: the
    # server answers none until all have arrived, so a capped pool would time out.
    n = 120

    async def main() -> list[RequestResult]:
        all_in = asyncio.Event()

        async def handler(_, writer):
            if len(received) == n:
                all_in.set()
            await all_in.wait()
            writer.write(SSE_HEAD + event({"choices": [{"text": "a"}]}) + event("[DONE]") + b"0\r\n\r\n")
            await writer.drain()

        async with scripted_server(handler) as (url, received), http_client.session(20.0) as session:
            payload = endpoint.build_payload(endpoint.COMPLETIONS, "m", SampleRequest([5], 1, 1),
                                             ignore_eos=False, extra_body={})
            return await asyncio.gather(*[endpoint.send(session, f"{url}/v1/completions", payload, {}, 1)
                                          for _ in range(n)])

    results = asyncio.run(main())
    assert all(r.success for r in results), {r.error for r in results}


def test_bench_serve_without_aiohttp_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "aiohttp", None)          # `import aiohttp` raises ImportError
    assert cli_main(["bench", "serve", "--num-prompts", "1", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err
    assert "deepinfer bench serve needs aiohttp" in err and "pip install 'deepinfer[bench]'" in err, err


def test_the_cli_loads_without_aiohttp():
    # In a fresh interpreter, so that nothing has imported aiohttp yet: the CLI and every
    # module of the benchmark load without it, and only the run asks for it.
    code = ("import sys; sys.modules['aiohttp'] = None\n"
            "from deepinfer.entrypoints.cli import build_parser, main\n"
            "assert 'bench' in build_parser().format_help()\n"
            "sys.exit(main(['bench', 'serve', '--num-prompts', '1']))")
    root = Path(deepinfer.__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "pip install 'deepinfer[bench]'" in p.stderr, p.stderr


def test_endpoint_kind_from_path():
    assert endpoint.endpoint_type("/v1/completions") == endpoint.COMPLETIONS
    assert endpoint.endpoint_type("/v1/chat/completions/") == endpoint.CHAT
    with pytest.raises(ValueError, match="--endpoint"):
        endpoint.endpoint_type("/v1/embeddings")
    with pytest.raises(ValueError, match="token-id prompts"):
        endpoint.build_payload(endpoint.CHAT, "m", SampleRequest([1], 1, 1), ignore_eos=False, extra_body={})
