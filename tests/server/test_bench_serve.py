"""``deepinfer bench serve`` against our server on the embedded model: the result JSON
has vLLM's keys and values that hold together, on both endpoints, and requests the
server refuses are counted as failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deepinfer.engine.engine import Engine
from deepinfer.entrypoints.cli import main
from tests.server.conftest import API_KEY, MODEL, RunningServer, serve

STAT_KEYS = [f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl", "e2el")
             for stat in ("mean", "median", "std", "p90", "p99")]
RESULT_KEYS = ["date", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
               "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
               "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
               "max_output_tokens_per_s", "max_concurrent_requests", "input_lens", "output_lens", "ttfts",
               "itls", "latencies", "start_times", "generated_texts", "errors", *STAT_KEYS]


@pytest.fixture(scope="module")
def server(engine: Engine):
    with serve(engine, api_key=API_KEY) as s:
        yield s


def bench(server: RunningServer, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--disable-tqdm",
                 "--save-detailed", "--result-filename", str(out), "--metric-percentiles", "90,99", *extra])
    return code, json.loads(out.read_text())


def test_completions_token_prompts(server, tmp_path, capsys):
    code, r = bench(server, tmp_path, "--num-prompts", "6", "--random-input-len", "24", "--random-output-len", "8",
                    "--goodput", "ttft:60000", "tpot:60000", "--metadata", "hardware=cpu")
    assert code == 0
    assert set(RESULT_KEYS) <= set(r), set(RESULT_KEYS) - set(r)
    assert (r["completed"], r["failed"], r["model_id"], r["backend"]) == (6, 0, MODEL, "openai")
    assert r["tokenize_prompt"] is True and r["hardware"] == "cpu" and r["request_rate"] == "inf"
    assert "--api-key ***" in r["command"] and API_KEY not in r["command"]
    # Token-id prompts have exact lengths, and ignore_eos + min_tokens give every token asked for.
    assert r["input_lens"] == [24] * 6 and r["output_lens"] == [8] * 6
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (144, 48)
    assert r["errors"] == [""] * 6 and all(r["generated_texts"])
    for ttft, itl, e2el in zip(r["ttfts"], r["itls"], r["latencies"]):
        assert 0 < ttft <= e2el and e2el == pytest.approx(ttft + sum(itl))
        assert 1 <= len(itl) <= 7          # up to one event per token after the first
    assert 0 < r["duration"] and max(r["latencies"]) <= r["duration"]
    assert r["request_throughput"] == pytest.approx(6 / r["duration"])
    assert r["output_throughput"] == pytest.approx(48 / r["duration"])
    assert r["total_token_throughput"] == pytest.approx(192 / r["duration"])
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])     # SLOs of a minute
    assert r["mean_ttft_ms"] <= r["p99_ttft_ms"] <= 1000 * max(r["ttfts"]) + 1e-6
    assert r["mean_ttft_ms"] <= r["mean_e2el_ms"] and r["mean_tpot_ms"] > 0 and r["p99_itl_ms"] > 0
    assert 1 <= r["max_concurrent_requests"] <= 6
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    assert "Successful requests:                     6" in out and "P90 TPOT (ms):" in out


def test_chat_text_prompts_at_a_rate(server, tmp_path):
    code, r = bench(server, tmp_path, "--endpoint", "/v1/chat/completions", "--num-prompts", "4",
                    "--random-input-len", "16", "--random-output-len", "6", "--request-rate", "40",
                    "--max-concurrency", "2", "--seed", "1")
    assert code == 0 and (r["completed"], r["backend"], r["tokenize_prompt"]) == (4, "openai-chat", False)
    assert r["max_concurrency"] == 2 and r["request_rate"] == 40.0 and r["max_concurrent_requests"] <= 2
    assert r["output_lens"] == [6] * 4
    # The server counts the chat template's tokens around the 16 of the text.
    assert all(n > 16 for n in r["input_lens"])
    # Arrivals are spread (the first goes at 0), so later requests start later.
    assert r["start_times"] == sorted(r["start_times"]) and r["start_times"][-1] > r["start_times"][0]
    assert all(0 < t <= e for t, e in zip(r["ttfts"], r["latencies"]))


def test_refused_requests_are_counted_as_failed(server, tmp_path, capsys):
    # Longer than the model (2048 tokens): the server answers 400 to each.
    code, r = bench(server, tmp_path, "--num-prompts", "3", "--random-input-len", "2100",
                    "--random-output-len", "4")
    assert code == 1 and (r["completed"], r["failed"]) == (0, 3)
    assert all(e.startswith("HTTP 400") and "maximum context length" in e for e in r["errors"])
    assert r["output_lens"] == [0] * 3 and r["total_output_tokens"] == 0 and r["request_throughput"] == 0
    assert "no request completed" in capsys.readouterr().err


def test_wrong_api_key_and_no_server(server, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = main(["bench", "serve", "--base-url", server.url, "--api-key", "wrong", "--model", MODEL,
                 "--tokenizer", server.engine.config.model.path, "--num-prompts", "2",
                 "--random-input-len", "8", "--random-output-len", "2", "--disable-tqdm", "--save-detailed",
                 "--result-filename", str(out)])
    r = json.loads(out.read_text())
    assert code == 1 and r["failed"] == 2 and all(e.startswith("HTTP 401") for e in r["errors"])
    # Without --model the benchmark asks the server for it, and says so when nobody answers.
    code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--disable-tqdm"])
    assert code == 2 and "no answer from http://127.0.0.1:9/v1/models" in capsys.readouterr().err


def test_ignore_eos_gives_the_asked_length_when_eos_is_all_the_model_says(server, tmp_path):
    # A logit bias makes EOS (id 2) the only likely token: without ignore_eos every request
    # ends after it; with it (and min_tokens) every request runs to its length, its text
    # empty (EOS is skipped in the text), counted from the server's usage. The client sees
    # one event (the finish) per request then: TTFT = E2EL.
    eos_only = ["--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "5",
                "--extra-body", '{"logit_bias": {"2": 100}, "temperature": 0}']
    code, r = bench(server, tmp_path, *eos_only)
    assert code == 0 and r["completed"] == 3 and r["output_lens"] == [5] * 3
    assert r["generated_texts"] == [""] * 3
    # Asked for, token logprobs make each token visible to the client's clock though it has no text.
    code, r = bench(server, tmp_path, *eos_only[:-1], '{"logit_bias": {"2": 100}, "temperature": 0, "logprobs": 0}')
    assert code == 0 and r["output_lens"] == [5] * 3 and [len(itl) for itl in r["itls"]] == [4] * 3
    assert all(0 < t < e for t, e in zip(r["ttfts"], r["latencies"])) and r["p99_tpot_ms"] > 0
    code, r = bench(server, tmp_path, *eos_only, "--no-ignore-eos")
    assert code == 0 and r["completed"] == 3 and r["output_lens"] == [1] * 3
