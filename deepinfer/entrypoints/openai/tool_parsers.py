"""DeepSeek's tool-call formats: how the model writes calls, and how the server reads
them back (whole or streamed), writes them into a prompt, and forces them with a grammar.

Two formats, named as vLLM's ``--tool-call-parser`` values (the markers are the
DeepSeek vocabulary's tool tokens)::

    deepseek_v3  (DeepSeek-V3-0324, R1-0528)
      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
      ```json
      ARGS
      ```<｜tool▁call▁end｜>
      <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

    deepseek_v31  (DeepSeek-V3.1, V3.2-Exp)
      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
      <｜tool▁call▁begin｜>...<｜tool▁calls▁end｜>     (no newline between calls)

Both are "calls-begin, calls joined by a separator, calls-end", each call being
"call-begin, header prefix, NAME, header suffix, ARGS (a JSON object), arguments end",
so one parser serves both. Text before the calls block (and after it) is content.

What belongs here: the formats and the text-level parser. What does not: which
request gets tools, the OpenAI shapes (chat.py), the reasoning split (reasoning.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"

# OpenAI's limit on function names; a longer header than this cannot be a call.
MAX_NAME_LEN = 64
# The most whitespace characters in a row a forced call's arguments may hold: enough for
# pretty-printed JSON several levels deep, and a bound on how long a weak model can
# drift before the grammar makes it write the next token of the document.
MAX_ARGUMENT_WHITESPACE = 8


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallFormat:
    """One DeepSeek tool-call format (see the module doc)."""

    name: str
    header_prefix: str       # after call-begin, before the function name
    header_suffix: str       # between the name and the arguments
    args_end: str            # after the arguments (ends the call)
    separator: str           # between two calls

    @property
    def markers(self) -> tuple[str, ...]:
        """The vocabulary's tool tokens this format writes."""
        return CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP

    def render_call(self, name: str, arguments: str) -> str:
        return CALL_BEGIN + self.header_prefix + name + self.header_suffix + arguments + self.args_end

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """A whole calls block from (name, arguments JSON) pairs."""
        return CALLS_BEGIN + self.separator.join(self.render_call(n, a) for n, a in calls) + CALLS_END

    def tools_prompt(self, functions: Sequence[dict[str, Any]]) -> str:
        """DeepSeek's tool section of a system prompt (the layout of DeepSeek-V3.1's chat
        template), for templates that do not render tools themselves. ``functions`` are
        OpenAI function definitions (name, description, parameters)."""
        lines = ["## Tools", "You have access to the following tools:"]
        for f in functions:
            lines += ["", f"### {f['name']}", f"Description: {f.get('description') or ''}", "",
                      f"Parameters: {json.dumps(f.get('parameters') or {}, ensure_ascii=False)}"]
        example = (CALLS_BEGIN + self.render_call("tool_call_name", "tool_call_arguments")
                   + "{additional_tool_calls}" + CALLS_END)
        lines += ["", "IMPORTANT: ALWAYS adhere to this exact format for tool use:", example, "", "Where:",
                  "- `tool_call_name` must be an exact match to one of the available tools",
                  "- `tool_call_arguments` must be valid JSON that strictly follows the tool's "
                  "Parameters Schema",
                  f"- For multiple tool calls, chain them with {json.dumps(self.separator)} between them"]
        return "\n".join(lines)

    def calls_format(self, functions: Sequence[tuple[str, dict[str, Any]]], *,
                     parallel: bool) -> dict[str, Any]:
        """An xgrammar structural-tag format whose language is a calls block of one or more
        (only one unless ``parallel``) calls to ``functions`` ((name, parameters schema)
        pairs), each call's arguments satisfying its schema."""
        tags = [{"type": "tag", "begin": CALL_BEGIN + self.header_prefix + name + self.header_suffix,
                 "content": {"type": "json_schema", "json_schema": schema,
                             "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE},
                 "end": self.args_end} for name, schema in functions]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                 "at_least_one": True, "stop_after_first": not parallel}
        return {"type": "tag", "begin": CALLS_BEGIN, "content": calls, "end": CALLS_END}


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "deepseek_v3": ToolCallFormat("deepseek_v3", header_prefix="function" + TOOL_SEP,
                                  header_suffix="\n```json\n", args_end="\n```" + CALL_END, separator="\n"),
    "deepseek_v31": ToolCallFormat("deepseek_v31", header_prefix="", header_suffix=TOOL_SEP,
                                   args_end=CALL_END, separator=""),
}


def get_tool_call_format(name: str) -> ToolCallFormat:
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool call parser {name!r} is not known; known: {', '.join(sorted(TOOL_CALL_FORMATS))}")
    return TOOL_CALL_FORMATS[name]


# -- parsing ---------------------------------------------------------------------------------------
@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its first piece carries ``id`` and ``name``, the
    following ones only a fragment of the arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``: text
    that may still become the marker and must not be emitted yet."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


_TEXT, _BETWEEN, _HEADER, _ARGS = "text", "between", "header", "args"


class ToolCallStreamParser:
    """Splits model text into content and tool calls as it arrives.

    ``feed`` takes the next piece of text and returns, in order, content strings and
    ``ToolCallDelta`` pieces; ``finish`` returns what was held back. Text that may be
    the start of a marker is held back until the next piece decides it, so a marker
    split across tokens is never streamed as content. A calls block that turns out not
    to follow the format (an unexpected character between calls, a header that is not
    "prefix NAME suffix") is given back as content from the end of its last complete
    call on. A block may end without calls-end once a call is complete (a model that
    stops right after its last call). Calls beyond ``max_calls`` are parsed but not
    reported.
    """

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.calls: list[ParsedToolCall] = []
        self._state = _TEXT
        self._buf = ""
        # Block text since its start or its last complete call: given back if malformed.
        self._raw = ""
        self._malformed = False

    def feed(self, text: str) -> list[str | ToolCallDelta]:
        self._buf += text
        out: list[str | ToolCallDelta] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[str | ToolCallDelta]:
        """The held-back text: content, the rest of an unfinished call's arguments, or
        (for a block cut short before a call's arguments began) the block as content."""
        out: list[str | ToolCallDelta] = []
        if self._state == _TEXT:
            self._emit_text(out, self._buf)
        elif self._state == _ARGS:
            self._emit_args(out, self._buf)
        elif not (self._state == _BETWEEN and self._raw == "" and CALLS_END.startswith(self._buf.strip())):
            self._give_back(out)
        self._buf = ""
        return out

    @property
    def malformed(self) -> bool:
        """True if a calls block did not follow the format, or a call is unfinished."""
        return self._malformed or any(not c.complete for c in self.calls)

    # -- states ----------------------------------------------------------------------------------
    def _step(self, out: list[str | ToolCallDelta]) -> bool:
        """Consume what the buffer decides; True if the state changed (step again)."""
        fmt, buf = self.fmt, self._buf
        if self._state == _TEXT:
            i = buf.find(CALLS_BEGIN)
            if i < 0:
                keep = partial_marker(buf, CALLS_BEGIN)
                self._emit_text(out, buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            self._emit_text(out, buf[:i])
            self._consume(i + len(CALLS_BEGIN), raw_start=True)
            self._state = _BETWEEN
            return True
        if self._state == _BETWEEN:
            rest = buf.lstrip()
            skipped = len(buf) - len(rest)
            if rest.startswith(CALL_BEGIN):
                self._consume(skipped + len(CALL_BEGIN))
                self._state = _HEADER
                return True
            if rest.startswith(CALLS_END):
                self._consume(skipped + len(CALLS_END))
                self._raw = ""
                self._state = _TEXT
                return True
            if CALL_BEGIN.startswith(rest) or CALLS_END.startswith(rest):
                return False       # not decided yet (or only whitespace so far)
            self._give_back(out)
            return True
        if self._state == _HEADER:
            j = buf.find(fmt.header_suffix)
            limit = len(fmt.header_prefix) + MAX_NAME_LEN
            header = buf[:len(buf) - partial_marker(buf, fmt.header_suffix)] if j < 0 else buf[:j]
            name = header[len(fmt.header_prefix):]
            plausible = (header.startswith(fmt.header_prefix) if len(header) >= len(fmt.header_prefix)
                         else fmt.header_prefix.startswith(header))
            if not plausible or len(header) > limit or any(ch.isspace() for ch in name):
                self._give_back(out)
                return True
            if j < 0:
                return False
            if not name:
                self._give_back(out)
                return True
            self._consume(j + len(fmt.header_suffix))
            self.calls.append(ParsedToolCall(id=make_tool_call_id(), name=name))
            if self._reported(len(self.calls) - 1):
                out.append(ToolCallDelta(index=len(self.calls) - 1, id=self.calls[-1].id, name=name))
            self._state = _ARGS
            return True
        # _ARGS
        k = buf.find(fmt.args_end)
        if k < 0:
            keep = partial_marker(buf, fmt.args_end)
            self._emit_args(out, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        self._emit_args(out, buf[:k])
        self._buf = buf[k + len(fmt.args_end):]
        self.calls[-1].complete = True
        self._raw = ""
        self._state = _BETWEEN
        return True

    def _consume(self, n: int, raw_start: bool = False) -> None:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._raw = taken[taken.index(CALLS_BEGIN):] if raw_start else self._raw + taken

    def _give_back(self, out: list[str | ToolCallDelta]) -> None:
        """The block does not follow the format: its text since the last complete call
        (and the undecided buffer) is content, and parsing goes back to plain text."""
        self._malformed = True
        self._emit_text(out, self._raw + self._buf)
        self._raw = self._buf = ""
        self._state = _TEXT

    def _emit_text(self, out: list[str | ToolCallDelta], text: str) -> None:
        if text:
            out.append(text)

    def _emit_args(self, out: list[str | ToolCallDelta], text: str) -> None:
        if not text:
            return
        call = self.calls[-1]
        call.arguments += text
        self._raw += text
        if self._reported(len(self.calls) - 1):
            out.append(ToolCallDelta(index=len(self.calls) - 1, arguments=text))

    def _reported(self, index: int) -> bool:
        return self.max_calls is None or index < self.max_calls


@dataclass
class ParsedToolOutput:
    """A whole output split into content (None when empty) and tool calls."""

    content: str | None
    calls: list[ParsedToolCall]


def parse_tool_calls(fmt: ToolCallFormat, text: str, max_calls: int | None = None) -> ParsedToolOutput:
    """The tool calls in a whole output. Calls are returned only if the block follows the
    format, every call is complete and every call's arguments are a JSON object; otherwise
    the whole text is content (as a model that wrote a broken call gave no call)."""
    parser = ToolCallStreamParser(fmt, max_calls=max_calls)
    pieces = parser.feed(text) + parser.finish()
    calls = parser.calls[:max_calls] if max_calls is not None else parser.calls
    if not calls or parser.malformed or not all(_is_json_object(c.arguments) for c in parser.calls):
        return ParsedToolOutput(content=text or None, calls=[])
    content = "".join(p for p in pieces if isinstance(p, str))
    return ParsedToolOutput(content=content or None, calls=calls)


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False
