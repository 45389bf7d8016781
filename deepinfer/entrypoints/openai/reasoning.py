"""DeepSeek's thinking mode: the reasoning a model writes before its answer, split off
into ``reasoning_content``.

A thinking DeepSeek model writes ``reasoning</think>answer``: the chat template opens
the ``<think>`` block at the end of the prompt (a model may also write the opener
itself; it is dropped). Everything before ``</think>`` is reasoning, everything after
is content; an output that never closes the block is all reasoning. Parsers, named
as vLLM's ``--reasoning-parser`` values:

- ``deepseek_r1``: every request thinks.
- ``deepseek_v3``: a request thinks when its ``chat_template_kwargs`` set ``thinking``
  (DeepSeek-V3.1's template flag) or ``enable_thinking`` (the common spelling);
  otherwise the whole output is content.

What does not belong here: the template (it decides what the prompt opens), tool
calls (parsed from the content afterwards, tool_parsers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepinfer.entrypoints.openai.tool_parsers import partial_marker

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    switched: bool        # thinking only when the request's template kwargs ask for it

    def enabled(self, chat_template_kwargs: dict[str, Any] | None) -> bool:
        """Whether a request with these template kwargs thinks."""
        if not self.switched:
            return True
        kwargs = chat_template_kwargs or {}
        return bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))

    @staticmethod
    def grammar_prefix() -> dict[str, Any]:
        """An xgrammar structural-tag format for the reasoning block: any text up to
        ``</think>``. A grammar that constrains the answer goes after it, so thinking
        stays free (as in vLLM, where structured outputs start once reasoning ends)."""
        return {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": THINK_END}


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "deepseek_r1": ReasoningParser("deepseek_r1", switched=False),
    "deepseek_v3": ReasoningParser("deepseek_v3", switched=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {name!r} is not known; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


_OPENING, _REASONING, _CONTENT = "opening", "reasoning", "content"


class ReasoningStreamSplitter:
    """Splits a thinking model's text into (reasoning, content) pieces as it arrives.

    Text that may be the start of ``</think>`` (or, at the very start, of ``<think>``)
    is held back until the next piece decides it, so a marker split across tokens
    never leaks into either part.
    """

    def __init__(self) -> None:
        self._state = _OPENING
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) decided by this piece; either may be empty."""
        self._buf += text
        reasoning = content = ""
        if self._state == _OPENING:
            if self._buf.startswith(THINK_START):
                self._buf = self._buf[len(THINK_START):]
            elif THINK_START.startswith(self._buf):
                return "", ""           # may still become the opener
            self._state = _REASONING
        if self._state == _REASONING:
            i = self._buf.find(THINK_END)
            if i < 0:
                keep = partial_marker(self._buf, THINK_END)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:i], self._buf[i + len(THINK_END):]
            self._state = _CONTENT
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: an unclosed block's tail is reasoning."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self._state != _CONTENT else ("", rest)

    @property
    def in_reasoning(self) -> bool:
        return self._state != _CONTENT


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole output; None for an empty part."""
    splitter = ReasoningStreamSplitter()
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2) or None, (c1 + c2) or None
