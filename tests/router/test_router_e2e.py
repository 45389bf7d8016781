"""End to end on the embedded model: ``deepinfer serve --replicas 2`` (two engine processes
behind the router) and ``deepinfer bench serve --router`` over fresh replicas."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deepinfer.entrypoints.cli import main


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _router_samples(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx2.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.slow
def test_serve_replicas_routes_a_conversation_to_one_replica():
    port = _free_port()
    cmd = [sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", "--device", "cpu", "--replicas", "2",
           "--host", "127.0.0.1", "--port", str(port), "--api-key", "k1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx2.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < deadline, "the router did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-model"]
        messages = [{"role": "system", "content": "You answer briefly. " * 20}]
        cached = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question number {turn}?"})
            resp = client.chat.completions.create(model="tiny-model", messages=messages, max_tokens=6,
                                                  temperature=0, extra_body={"ignore_eos": True})
            messages.append({"role": "assistant", "content": resp.choices[0].message.content})
            cached.append(resp.usage.prompt_tokens_details.cached_tokens)
        # Later turns land on the replica holding the history, whose prefix cache serves it.
        assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]
        samples = _router_samples(url)
        chat = sorted(v for (name, labels), v in samples.items()
                      if name == "deepinfer_router_requests_total" and ("route", "/v1/chat/completions") in labels)
        assert chat == [3.0]
        assert sum(v for (name, _), v in samples.items() if name == "deepinfer_router_affinity_hits_total") == 2
        healthy = [v for (name, _), v in samples.items() if name == "deepinfer_router_backend_healthy"]
        assert healthy == [1.0, 1.0]
        # The backends check the API key; the router passes their 401 on.
        assert httpx2.get(url + "/v1/models", timeout=10).status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out


@pytest.mark.slow
def test_bench_serve_through_the_router(tmp_path: Path):
    out = tmp_path / "result.json"
    code = main(["bench", "serve", "--router", "cache-aware", "--replicas", "2", "--serve-args", "--device cpu",
                 "--endpoint", "/v1/chat/completions", "--dataset-name", "multiturn",
                 "--multiturn-conversations", "3", "--multiturn-turns", "2", "--multiturn-system-len", "64",
                 "--multiturn-question-len", "8", "--random-output-len", "4", "--disable-tqdm",
                 "--save-result", "--result-filename", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["router_policy"], r["replicas"]) == (6, 0, "cache-aware", 2)
    assert (r["num_prompts"], r["multiturn_conversations"], r["multiturn_turns"]) == (6, 3, 2)
    assert sum(r["requests_per_replica"]) == 6 and r["router_affinity_hits"] >= 3
    assert 0 < r["prefix_hit_rate"] < 1 and r["total_cached_tokens"] > 0
    assert len(r["mean_ttft_ms_per_turn"]) == 2
