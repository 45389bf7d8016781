"""End to end on the embedded model, as deployed: ``deepinfer serve --role prefill``,
``deepinfer serve --role decode`` and ``deepinfer router --prefill ... --decode ...`` as
three processes. Through the router a chat answer equals the decode instance's own, its
prompt served by the prefill instance's KV blocks; once the prefill process is killed,
requests fail with a 502 in seconds and the router exits cleanly."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx2
import openai
import pytest

CLI = [sys.executable, "-m", "deepinfer.entrypoints.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(CLI + args + ["--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            if httpx2.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx2.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not come up"
        time.sleep(0.2)


@pytest.mark.slow
def test_pd_processes_and_a_killed_prefill():
    prefill, prefill_url = _start(["serve", "--device", "cpu", "--role", "prefill"])
    decode, decode_url = _start(["serve", "--device", "cpu", "--role", "decode", "--kv-offload-gib", "0.01"])
    procs = [prefill, decode]
    try:
        _wait_healthy(prefill, prefill_url)
        _wait_healthy(decode, decode_url)
        router, url = _start(["router", "--prefill", prefill_url, "--decode", decode_url,
                              "--health-interval", "0.5"])
        procs.append(router)
        _wait_healthy(router, url, 60)
        messages = [{"role": "user", "content": " ".join(f"item{i}" for i in range(80))}]
        kwargs = dict(model="tiny-model", messages=messages, max_tokens=8, temperature=0, logprobs=True,
                      extra_body={"ignore_eos": True})
        via = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=60)
        got = via.chat.completions.create(**kwargs)
        assert got.usage.prompt_tokens_details.cached_tokens > 0
        direct = openai.OpenAI(base_url=decode_url + "/v1", api_key="-", max_retries=0, timeout=60)
        want = direct.chat.completions.create(**kwargs)
        assert got.choices[0].message.content == want.choices[0].message.content
        for g, w in zip(got.choices[0].logprobs.content, want.choices[0].logprobs.content):
            assert g.token == w.token and abs(g.logprob - w.logprob) <= 1e-5

        prefill.kill()
        prefill.wait(30)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as err:
            via.chat.completions.create(**kwargs)
        assert err.value.status_code in (502, 503) and "prefill" in str(err.value)
        assert time.monotonic() - t0 < 30
        assert httpx2.get(url + "/health", timeout=5).status_code == 503
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        outs = [proc.communicate(timeout=60)[0] for proc in reversed(procs)]
    assert all(proc.returncode == 0 for proc in procs[1:]), outs      # decode and router exit cleanly
