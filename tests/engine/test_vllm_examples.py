"""vLLM's offline examples (examples/vllm/: basic, chat, token-id prompts, sampling options),
written as for vLLM with only the import changed and the model left to the embedded default,
run here: each must finish and print what vLLM's would."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "vllm"


def run_example(name: str, argv: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setattr(sys, "argv", [name, *argv])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_examples_name_deepinfer_only_in_imports(name):
    code = (EXAMPLES / name).read_text()
    body = code.split('"""', 2)[2]          # past the module docstring
    lines = [line for line in body.splitlines() if "deepinfer" in line]
    assert lines and all(re.match(r"from deepinfer(\.inputs)? import ", line) for line in lines), lines
    assert "LLM()" in body                  # the embedded default model


def test_basic(monkeypatch, capsys):
    out = run_example("basic.py", [], monkeypatch, capsys)
    assert out.count("Prompt: ") == 4 and out.count("Output: ") == 4
    assert "'The capital of France is'" in out


def test_chat(monkeypatch, capsys, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    out = run_example("chat.py", ["--max-tokens", "8", "--temperature", "0", "--chat-template-path",
                                  str(template)], monkeypatch, capsys)
    assert out.count("Generated text: ") == 21         # 1 + 10 + 10 with the given template
    assert "<|im_start|>assistant\\n'" in out and "assistant:'" in out


def test_token_ids(monkeypatch, capsys):
    out = run_example("token_ids.py", [], monkeypatch, capsys)
    blocks = out.split("-" * 60)[:4]
    ids = [re.search(r"Token ids: (\[.*\])", b).group(1) for b in blocks]
    assert ids[0] == ids[1]                 # the same prompt as ids and as text, greedy
    assert "Prompt: None" in blocks[0] and "Prompt: 'The capital of France is'" in blocks[1]


def test_sampling_params(monkeypatch, capsys):
    out = run_example("sampling_params.py", [], monkeypatch, capsys)
    assert out.count("== ") == 6
    two = out.split("== two seeded samples")[1].split("==")[0]
    assert "[0] " in two and "[1] " in two
    assert "stop_reason='.'" in out.split("== stop at a period")[1].split("==")[0]
    assert "first token's top logprobs" in out
