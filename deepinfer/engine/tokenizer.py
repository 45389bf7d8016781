"""Tokenizer, chat template and incremental detokenizer with stop strings.

What belongs here: turning text into token ids and back, for whole strings and
for a stream of generated tokens. The serving path depends on ``tokenizers`` and
``jinja2`` only; ``transformers`` is used by the tests to check that we agree
with it, never imported here.

Behaviour follows transformers 5 on checkpoints that ship a ``tokenizer.json``:
the post-processor inside ``tokenizer.json`` decides whether ``encode`` adds BOS
(transformers 5 ignores ``add_bos_token`` from ``tokenizer_config.json`` when
that file exists), and ``clean_up_tokenization_spaces`` is not applied because
transformers 5 skips it for BPE models, which every supported family uses.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# The named special tokens a chat template can read as variables (transformers'
# SPECIAL_TOKENS_ATTRIBUTES).
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                        "mask_token")

# How many prompt tokens the detokenizer decodes as left context for the first
# generated token (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): decoders
# such as SentencePiece's Metaspace render a token differently at the start of a
# string, so the new text is always measured against a decoded prefix.
_INITIAL_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: Any) -> str | None:
    """A special token in tokenizer_config.json is a string or a serialised AddedToken."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: special token {value!r} is neither a string nor "
                     "an object with a 'content' string")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_environment() -> jinja2.Environment:
    """Like transformers: sandboxed, trim_blocks/lstrip_blocks, loop controls, and the
    helpers templates on the Hub call."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile_chat_template(source: str) -> jinja2.Template:
    return _template_environment().from_string(source)


class Tokenizer:
    """The tokenizer of one checkpoint directory.

    Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens,
    chat template) and ``generation_config.json`` (extra EOS ids), plus
    ``chat_template.jinja`` when present (it takes priority, as in transformers).
    """

    def __init__(self, path: str) -> None:
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"tokenizer: no tokenizer.json in {str(root)!r}")
        self._tok = _HFTokenizer.from_file(str(tok_file))
        config = _read_json(root / "tokenizer_config.json")
        gen_config = _read_json(root / "generation_config.json")

        self.special_tokens_map: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens_map[name] = content

        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._special_id("bos_token")
        self.eos_token_ids: set[int] = set()
        eos = self._special_id("eos_token")
        if eos is not None:
            self.eos_token_ids.add(eos)
        gen_eos = gen_config.get("eos_token_id")
        for tid in ([gen_eos] if isinstance(gen_eos, int) else gen_eos or []):
            if not 0 <= int(tid) < self.vocab_size:
                raise ValueError(f"generation_config.json: eos_token_id {tid} is outside the "
                                 f"vocabulary [0, {self.vocab_size})")
            self.eos_token_ids.add(int(tid))

        added = self._tok.get_added_tokens_decoder()
        self.added_token_ids: frozenset[int] = frozenset(added)
        self.all_special_ids: set[int] = {tid for tid, tok in added.items() if tok.special}
        for name in self.special_tokens_map:
            tid = self._special_id(name)
            if tid is not None:
                self.all_special_ids.add(tid)

        self._chat_templates = self._find_chat_templates(root, config)
        self._compiled: dict[str, jinja2.Template] = {}

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens_map.get(name)
        if content is None:
            return None
        tid = self._tok.token_to_id(content)
        if tid is None:
            raise ValueError(f"tokenizer_config.json: {name}={content!r} is not in the vocabulary "
                             "of tokenizer.json")
        return tid

    @staticmethod
    def _find_chat_templates(root: Path, config: dict[str, Any]) -> dict[str, str]:
        """Named chat templates; "default" renders conversations, "tool_use" (when
        present) those with tools, as in transformers."""
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            return {"default": jinja_file.read_text(encoding="utf-8")}
        template = config.get("chat_template")
        if template is None:
            return {}
        if isinstance(template, str):
            return {"default": template}
        return {t["name"]: t["template"] for t in template}

    # -- text <-> ids -------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are matched as such."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """The text of ``ids``. ``spaces_between_special_tokens=False`` (vLLM's option) decodes
        the runs between two adjacent added tokens apart and joins them, so nothing the
        decoder would put between two added tokens remains (with the byte-level decoders of
        the supported families the text is the same either way)."""
        ids = list(ids)
        if spaces_between_special_tokens or skip_special_tokens:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        added = self.added_token_ids
        cuts = [i for i in range(1, len(ids)) if ids[i - 1] in added and ids[i] in added]
        bounds = [0, *cuts, len(ids)]
        return "".join(self._tok.decode(ids[a:b], skip_special_tokens=False) for a, b in zip(bounds, bounds[1:]))

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """transformers' call shape: ``{"input_ids": ids}`` (a list of id lists for a list of texts)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": [self.encode(t, add_special_tokens) for t in text]}

    def id_to_token_text(self, token_id: int) -> str:
        """The decoded text of one token (special tokens included), as logprobs show it."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    # -- chat ---------------------------------------------------------------------
    def chat_template_source(self, with_tools: bool = False) -> str | None:
        """The chat template's Jinja source (the one used when tools are given, for
        ``with_tools``), or None when the checkpoint has none."""
        name = "tool_use" if with_tools and "tool_use" in self._chat_templates else "default"
        return self._chat_templates.get(name)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            *, chat_template: str | None = None, continue_final_message: bool = False,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render a conversation with the checkpoint's chat template (or ``chat_template``,
        a Jinja source given by the caller).

        ``kwargs`` become template variables (``tools``, ``documents``,
        ``enable_thinking``, ...) and override the special-token variables.
        Message keys whose value is None are dropped, as transformers does, since
        templates test for a missing key rather than for None.
        ``continue_final_message`` (as in transformers) cuts the text right after the last
        message's content, so that generation continues that message; it excludes
        ``add_generation_prompt``. ``tokenize=True`` returns the token ids of the text
        (special tokens as written by the template, none added).
        """
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True continues the last message, add_generation_prompt="
                             "True starts a new one: pass add_generation_prompt=False")
        text = self._render(messages, add_generation_prompt, chat_template, kwargs)
        if continue_final_message:
            text = _cut_after_final_message(text, messages)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _render(self, messages: list[dict], add_generation_prompt: bool, chat_template: str | None,
                kwargs: dict[str, Any]) -> str:
        if chat_template is not None:
            if not isinstance(chat_template, str) or not chat_template:
                raise ValueError("chat_template must be a non-empty Jinja template string")
            source = chat_template
        else:
            source = self._checkpoint_template(kwargs.get("tools") is not None)
        if not messages:
            raise ValueError("messages is empty: a conversation needs at least one message")
        if source not in self._compiled:
            self._compiled[source] = _compile_chat_template(source)
        conversation = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise TypeError(f"messages[{i}] is {type(message).__name__}; each message must be a dict")
            conversation.append({k: v for k, v in message.items() if v is not None})
        variables: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens_map,
                                     **kwargs}
        return self._compiled[source].render(messages=conversation,
                                            add_generation_prompt=add_generation_prompt, **variables)

    def _checkpoint_template(self, with_tools: bool) -> str:
        """The checkpoint's template source: "tool_use" for a conversation with tools when
        there is one, else "default"."""
        name = "tool_use" if with_tools and "tool_use" in self._chat_templates else "default"
        if name not in self._chat_templates:
            if self._chat_templates:
                raise ValueError(f"tokenizer_config.json: chat_template lists {sorted(self._chat_templates)} "
                                 "but none is named 'default'")
            raise ValueError("this checkpoint has no chat template (no chat_template in "
                             "tokenizer_config.json and no chat_template.jinja); use generate() with "
                             "a plain prompt instead of chat(), or pass chat_template")
        return self._chat_templates[name]


def _message_text(content: Any) -> str | None:
    """The text a message's content ends with: the string, or the last text part of a list."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                return part["text"]
    return None


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """``text`` up to the end of the last message's content (the last occurrence of it), so
    that the template's end-of-message tokens are left off. A template may strip the
    content's surrounding whitespace, so it is looked for stripped; its trailing spaces are
    kept only where the rendered text has them too."""
    final = _message_text(messages[-1].get("content") if isinstance(messages[-1], dict) else None)
    if not final or not final.strip():
        raise ValueError("continue_final_message=True but the last message has no text to continue")
    core = final.strip()
    at = text.rfind(core)
    if at < 0:
        raise ValueError("continue_final_message=True but the chat template does not write the last "
                         "message's text as given, so it cannot be continued")
    full = final.lstrip()
    end = at + (len(full) if text.startswith(full, at) else len(core))
    return text[:end]


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text as they arrive, and finds stop strings.

    Decoding follows vLLM's prefix/read offsets: the text of the tokens in
    ``[prefix_offset, read_offset)`` was already emitted; decoding
    ``[prefix_offset, end)`` and removing that prefix gives the new text. While the
    new text ends in U+FFFD (a byte-level token that is part of an unfinished
    UTF-8 character) it stays pending and nothing is committed, so a character
    split over several tokens is emitted once, whole.

    ``text`` is the committed text plus the pending tail, so it always equals what
    a full decode gives; ``stream_delta`` only ever streams committed text (except
    when finished), minus a holdback so that a stop string spanning tokens is never
    streamed.

    Stop strings are searched only in newly produced text, and only once
    ``min_tokens`` tokens have been generated (text produced before that does not
    count, as in vLLM). When several stop strings match, the earliest match wins
    (the longest at a tie).
    After a stop string is hit the text is frozen; later tokens are still recorded
    in ``token_ids`` so the caller's bookkeeping stays aligned.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False, *, min_tokens: int = 0,
                 spaces_between_special_tokens: bool = True) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []        # generated tokens only
        self.stop_reason: str | None = None
        self._all_ids = list(prompt_token_ids)
        self._read_offset = len(self._all_ids)
        self._prefix_offset = max(self._read_offset - _INITIAL_CONTEXT_TOKENS, 0)
        self._committed = ""                  # output text whose characters are complete
        self._pending = ""                    # decoded tail ending in an unfinished character
        self._stop_search_floor = 0           # stop strings must end after this text position
        self._holdback = max((len(s) - 1 for s in self.stop), default=0)
        self._streamed = 0                    # characters of .text returned by stream_delta

    @property
    def text(self) -> str:
        return self._committed + self._pending

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Append generated tokens; returns the stop string if one was hit by them."""
        old_len = len(self._committed)
        for tid in token_ids:
            self.token_ids.append(int(tid))
            if self.stop_reason is not None:
                continue
            self._all_ids.append(int(tid))
            self._decode_next()
            if len(self.token_ids) <= self.min_tokens:
                self._stop_search_floor = len(self._committed)
        if self.stop_reason is not None or not self.stop:
            return None
        return self._check_stop(max(old_len, self._stop_search_floor))

    def _decode_next(self) -> None:
        prefix = self.tokenizer.decode(self._all_ids[self._prefix_offset:self._read_offset],
                                       self.skip_special_tokens, self.spaces_between_special_tokens)
        full = self.tokenizer.decode(self._all_ids[self._prefix_offset:],
                                     self.skip_special_tokens, self.spaces_between_special_tokens)
        new = full[len(prefix):]
        # Keep the window (do not advance the offsets) while the new tokens render as
        # nothing (a skipped special token) or end inside a character: the next
        # decode then still has real left context.
        if not new or full.endswith(_REPLACEMENT_CHAR):
            self._pending = new
            return
        self._committed += new
        self._pending = ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._all_ids)

    def _check_stop(self, searched_up_to: int) -> str | None:
        best: tuple[int, int, str] | None = None      # (position, -length, stop string)
        for s in self.stop:
            # A match must end in new text: start no earlier than len(s)-1 before it.
            pos = self._committed.find(s, max(0, searched_up_to - len(s) + 1))
            if pos != -1 and (best is None or (pos, -len(s)) < best[:2]):
                best = (pos, -len(s), s)
        if best is None:
            return None
        pos, _, s = best
        self._committed = self._committed[:pos + len(s) if self.include_stop_str_in_output else pos]
        self._pending = ""
        self.stop_reason = s
        return s

    def stream_delta(self, finished: bool) -> str:
        """Text not returned by earlier calls. While unfinished it holds back the last
        ``len(longest stop) - 1`` committed characters and any unfinished character."""
        if finished or self.stop_reason is not None:
            end = len(self.text)
        else:
            end = len(self._committed) - self._holdback
        if end <= self._streamed:
            return ""
        delta = self.text[self._streamed:end]
        self._streamed = end
        return delta
