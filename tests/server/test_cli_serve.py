"""``deepinfer serve`` end to end: the CLI in a subprocess, its flags, clean shutdown."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx2
import openai
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_command():
    port = _free_port()
    cmd = [sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--api-key", "k1",
           "--served-model-name", "my-model", "alias", "--max-model-len", "128",
           "--tool-call-parser", "deepseek_v31", "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_v3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx2.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx2.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["my-model", "alias"]
        assert client.models.list().data[0].model_extra["max_model_len"] == 128
        resp = client.completions.create(model="alias", prompt="The list type", max_tokens=4,
                                         extra_body={"ignore_eos": True})
        assert resp.model == "my-model" and resp.usage.completion_tokens == 4
        # The reasoning and tool flags reached the server: thinking splits off reasoning, and
        # tool_choice "auto" is accepted (its tool section then overflows --max-model-len 128).
        chat = client.chat.completions.create(model="alias", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, extra_body={"chat_template_kwargs": {"thinking": True}})
        assert chat.choices[0].message.model_extra["reasoning_content"] and chat.choices[0].message.content is None
        with pytest.raises(openai.BadRequestError, match="maximum context length is 128"):
            client.chat.completions.create(model="alias", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                           tools=[{"type": "function", "function": {"name": "f"}}])
        assert httpx2.get(url + "/v1/models").status_code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, out


def test_serve_auto_tool_choice_needs_a_parser():
    proc = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "serve", "--enable-auto-tool-choice"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser" in proc.stderr
