"""Tokenizer and chat template against transformers' tokenizer loaded from the same files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFBackend
from tokenizers import processors

from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.entrypoints.llm import DEFAULT_MODEL

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines\r\n",
    "Return a new list containing all items from the iterable in ascending order.",
    "naïve café — déjà vu; 数学 and 日本語のテキスト",
    "emoji: 🤖🚀 and a family 👨‍👩‍👧 with ZWJ, flags 🇫🇷",
    "special tokens inline: <|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
    "x" * 300,
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module", params=["auto", "fast"])
def hf(request):
    if request.param == "auto":
        return transformers.AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    template = json.loads((Path(DEFAULT_MODEL) / "tokenizer_config.json").read_text())["chat_template"]
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(Path(DEFAULT_MODEL) / "tokenizer.json"), eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=template)


def test_encode_decode_match_transformers(tok, hf):
    for text in TEXTS:
        for add in (True, False):
            ids = tok.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), text
        ids = tok.encode(text)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        # byte-level BPE round-trips any string exactly
        assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_ids_and_sizes(tok, hf):
    assert tok.vocab_size == len(hf) == 1000
    endoftext, im_start, im_end = (hf.convert_tokens_to_ids(t)
                                   for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    assert tok.eos_token_ids == {endoftext, im_end}
    assert tok.bos_token_id is None
    assert {endoftext, im_start, im_end} <= tok.all_special_ids
    assert set(hf.all_special_ids) <= tok.all_special_ids
    gen = json.loads((Path(DEFAULT_MODEL) / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) == tok.eos_token_ids
    # special tokens written in text are single tokens, and skipped on decode
    ids = tok.encode("a<|im_end|>b")
    assert im_end in ids
    assert tok.decode(ids) == "ab"


def test_id_to_token_text_matches_transformers(tok, hf):
    for tid in range(tok.vocab_size):
        assert tok.id_to_token_text(tid) == hf.decode([tid], skip_special_tokens=False), tid


CONVERSATIONS = [
    [{"role": "user", "content": "What does json.dumps do?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Say hi 👋"},
     {"role": "assistant", "content": "Hi."},
     {"role": "user", "content": "Again, in 日本語."}],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                  {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "tools?"}, {"role": "assistant", "content": None}],
]


def test_chat_template_matches_transformers(tok, hf):
    for conv in CONVERSATIONS:
        for gen in (True, False):
            ours = tok.apply_chat_template(conv, add_generation_prompt=gen)
            theirs = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert ours == theirs
    text = tok.apply_chat_template(CONVERSATIONS[0])
    assert text == "<|im_start|>user\nWhat does json.dumps do?<|im_end|>\n<|im_start|>assistant\n"


def test_no_chat_template_is_a_clear_error(tmp_path):
    shutil.copy(Path(DEFAULT_MODEL) / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((Path(DEFAULT_MODEL) / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(str(tmp_path / "missing"))


# A Llama-3-like checkpoint: BOS added by the post-processor, a template that uses
# bos_token, raise_exception, tojson, namespace and loop controls.
LLAMA_LIKE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(n=0) %}"
    "{%- if tools is not none %}{{- 'TOOLS ' + (tools | tojson) + '\\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + m['role']) }}{%- endif %}"
    "{%- if m['role'] == 'system' and loop.index0 > 0 %}{%- continue %}{%- endif %}"
    "{%- set ns.n = ns.n + 1 %}"
    "<|start|>{{ m['role'] }}\n"
    "  {{ m['content'] | trim }}<|end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant #{{ ns.n }}\n{%- endif %}"
    "{%- if eos_in_prompt | default(false) %}{{ eos_token }}{%- endif %}"
)


@pytest.fixture(scope="module")
def llama_like_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama_like")
    t = HFBackend.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))
    t.add_special_tokens(["<|begin|>", "<|start|>", "<|end|>", "<|eot|>"])
    bos = t.token_to_id("<|begin|>")
    t.post_processor = processors.TemplateProcessing(single="<|begin|> $A", pair="<|begin|> $A <|begin|> $B",
                                                     special_tokens=[("<|begin|>", bos)])
    t.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eot|>", "special": True}, "add_bos_token": True,
        "chat_template": LLAMA_LIKE_TEMPLATE}))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": t.token_to_id("<|end|>")}))
    return out


def test_bos_checkpoint_and_template_features(llama_like_dir):
    ours = Tokenizer(str(llama_like_dir))
    hf = transformers.AutoTokenizer.from_pretrained(str(llama_like_dir))
    bos = hf.convert_tokens_to_ids("<|begin|>")
    assert ours.bos_token_id == bos
    assert ours.eos_token_ids == {hf.convert_tokens_to_ids("<|eot|>"), hf.convert_tokens_to_ids("<|end|>")}
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.encode("hi")[0] == bos
    assert ours.decode(ours.encode("hi")) == "hi"
    conv = [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "Ünïcode 🚀"},
            {"role": "system", "content": "skipped by continue"}, {"role": "assistant", "content": "ok"}]
    tools = [{"name": "f", "description": "naïve <b>html</b>"}]
    for kwargs in ({}, {"tools": tools}, {"eos_in_prompt": True}):
        for gen in (True, False):
            assert (ours.apply_chat_template(conv, add_generation_prompt=gen, **kwargs)
                    == hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False, **kwargs))
    rendered = ours.apply_chat_template(conv, tools=tools)
    assert rendered.startswith('<|begin|>TOOLS [{"name": "f", "description": "naïve <b>html</b>"}]\n')
    assert rendered.endswith("<|end|><|start|>assistant #3")
    import jinja2
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_named_chat_templates(tmp_path):
    shutil.copy(Path(DEFAULT_MODEL) / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((Path(DEFAULT_MODEL) / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        # indented block tags on their own lines: trim_blocks and lstrip_blocks remove them
        {"name": "default", "template": "{% for m in messages %}\n  {% if m['role'] == 'user' %}\n"
                                        "[{{ m['content'] }}]\n  {% endif %}\n{% endfor %}"},
        {"name": "tool_use", "template": "{{ tools | length }} tools: {{ messages[0]['content'] }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = Tokenizer(str(tmp_path))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    conv = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    tools = [{"name": "f"}, {"name": "g"}]
    assert ours.apply_chat_template(conv) == hf.apply_chat_template(conv, tokenize=False) == "[a]\n"
    assert (ours.apply_chat_template(conv, tools=tools)
            == hf.apply_chat_template(conv, tools=tools, tokenize=False) == "2 tools: a")
    cfg["chat_template"] = cfg["chat_template"][1:]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="none is named 'default'"):
        Tokenizer(str(tmp_path)).apply_chat_template(conv)
