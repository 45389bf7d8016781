"""Chat rendering with tools: a template with tool support gets tools and calls as they
are (the checkpoint's template is the source of truth); one without gets them in
DeepSeek's format (the token formats' and the DSML ones'). And the check that turns special-token skipping off when the
markers a parser reads are special tokens of the vocabulary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.entrypoints.openai.chat import _markers_are_special
from deepinfer.entrypoints.openai.protocol import ChatMessage
from deepinfer.entrypoints.openai.serving import APIError, render_chat
from deepinfer.entrypoints.openai.tool_parsers import OUTPUT_BEGIN, OUTPUT_END, TOOL_CALL_FORMATS

V31 = TOOL_CALL_FORMATS["deepseek_v31"]
V32 = TOOL_CALL_FORMATS["deepseek_v32"]
V41 = TOOL_CALL_FORMATS["deepseek_v41"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "sunny"},
]
# A template that renders tools and calls itself (in its own made-up syntax) and reads a thinking flag.
TOOL_TEMPLATE = (
    "{% if tools %}[TOOLS {% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments }}]{% endfor %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% if thinking %}<think>{% endif %}{% endif %}")


def _tokenizer(tmp_path: Path, template: str | None = None, special: list[str] = ()) -> Tokenizer:
    shutil.copy(Path(DEFAULT_MODEL) / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((Path(DEFAULT_MODEL) / "tokenizer_config.json").read_text())
    if template is not None:
        config["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if special:
        tok = json.loads((tmp_path / "tokenizer.json").read_text())
        for i, content in enumerate(special):
            tok["added_tokens"].append({"id": 1000 + i, "content": content, "single_word": False, "lstrip": False,
                                        "rstrip": False, "normalized": False, "special": True})
        (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    return Tokenizer(str(tmp_path))


def _messages() -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in CONVERSATION]


def test_a_tool_template_gets_tools_and_calls_as_they_are(tmp_path):
    tok = _tokenizer(tmp_path, TOOL_TEMPLATE)
    text = render_chat(tok, _messages(), True, {"thinking": True}, tools=TOOLS, tool_format=V31)
    assert text == ("[TOOLS get_weather;]<system>Be brief.<user>Weather in Paris?<assistant>Checking."
                    '[CALL call_7 get_weather {"city": "Paris"}]<tool>sunny<assistant><think>')


def test_a_template_without_tools_gets_deepseek_format():
    tok = Tokenizer(DEFAULT_MODEL)
    text = render_chat(tok, _messages(), True, None, tools=TOOLS, tool_format=V31)
    section = V31.tools_prompt([TOOLS[0]["function"]])
    call = V31.render_calls([("get_weather", '{"city": "Paris"}')])
    assert text == (f"<|im_start|>system\nBe brief.\n\n{section}<|im_end|>\n"
                    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                    f"<|im_start|>assistant\nChecking.{call}<|im_end|>\n"
                    f"<|im_start|>tool\n{OUTPUT_BEGIN}sunny{OUTPUT_END}<|im_end|>\n"
                    "<|im_start|>assistant\n")
    # No tools (tool_choice "none" or none given): the calls and outputs are still rendered.
    bare = render_chat(tok, _messages(), True, None, tool_format=V31)
    assert section not in bare and call in bare and "<|im_start|>system\nBe brief.<|im_end|>" in bare
    # A conversation without a system message gets one for the tool section.
    first = render_chat(tok, _messages()[1:2], True, None, tools=TOOLS, tool_format=V31)
    assert first.startswith(f"<|im_start|>system\n{section}<|im_end|>\n<|im_start|>user\n")


def test_a_template_without_tools_gets_dsml_layout():
    """The DSML formats: the tool section, a blank line and the calls block after the
    assistant's text, each result in the format's tags (V3.2 also wraps a turn's results)."""
    tok = Tokenizer(DEFAULT_MODEL)
    parallel = CONVERSATION[:2] + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{city}", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "days": 2})}}
            for city in ("Paris", "Oslo")]},
        {"role": "tool", "tool_call_id": "call_Paris", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_Oslo", "content": "snow"},
        {"role": "user", "content": "Thanks"}]
    messages = [ChatMessage.model_validate(m) for m in parallel]
    for fmt, outputs in ((V32, ["<function_results>\n<result>sunny</result>",
                                "<result>snow</result>\n</function_results>"]),
                         (V41, ["<tool_result>sunny</tool_result>", "<tool_result>snow</tool_result>"])):
        text = render_chat(tok, messages, True, None, tools=TOOLS, tool_format=fmt)
        section = fmt.tools_prompt([TOOLS[0]["function"]])
        calls = fmt.render_calls([("get_weather", '{"city": "Paris", "days": 2}'),
                                  ("get_weather", '{"city": "Oslo", "days": 2}')])
        assert 'name="city" string="true">Oslo<' in calls and 'name="days" string="false">2<' in calls
        assert text == (f"<|im_start|>system\nBe brief.\n\n{section}<|im_end|>\n"
                        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                        f"<|im_start|>assistant\n{calls}<|im_end|>\n"
                        f"<|im_start|>tool\n{outputs[0]}<|im_end|>\n<|im_start|>tool\n{outputs[1]}<|im_end|>\n"
                        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_dsml_calls_need_object_arguments():
    bad = CONVERSATION[:2] + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "[1, 2]"}}]}]
    with pytest.raises(APIError, match="must be a JSON object") as info:
        render_chat(Tokenizer(DEFAULT_MODEL), [ChatMessage.model_validate(m) for m in bad], True, None,
                    tool_format=V32)
    assert info.value.status == 400 and info.value.param == "messages[2].tool_calls"


@pytest.mark.parametrize("special, markers, expected", [
    ([], ("<think>", "</think>"), False),
    (["</think>"], ("<think>", "</think>"), True),
    (["</think>"], V31.markers, False),
    (["｜DSML｜"], V41.markers, True),      # DeepSeek-V3.2's vocabulary holds the DSML piece as special
])
def test_markers_are_special(tmp_path, special, markers, expected):
    state = SimpleNamespace(tokenizer=_tokenizer(tmp_path, special=special))
    assert _markers_are_special(state, markers) is expected
