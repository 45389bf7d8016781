"""DeepSeek's tool-call formats: how the model writes calls, and how the server reads
them back (whole or streamed), writes them into a prompt, and forces them with a grammar.

Five formats, named as vLLM's ``--tool-call-parser`` values. Two are written with the
DeepSeek vocabulary's tool tokens::

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
so one parser (``ToolCallStreamParser``) serves both.

Three are DSML, DeepSeek's XML-like markup (the ``｜DSML｜`` piece is a special token of
the V3.2 vocabulary), as DeepSeek's chat encodings write it after the reply's text::

    deepseek_v32  (DeepSeek-V3.2)

      <｜DSML｜function_calls>
      <｜DSML｜invoke name="NAME">
      <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
      <｜DSML｜parameter name="KEY2" string="false">JSON</｜DSML｜parameter>
      </｜DSML｜invoke>
      <｜DSML｜invoke name="NAME2">
      ...
      </｜DSML｜invoke>
      </｜DSML｜function_calls>

    deepseek_v4   (DeepSeek-V4): the same, the block named ``tool_calls``
    deepseek_v41  (DeepSeek-V4.1): ``<｜DSML｜ calls>``, ``<｜DSML｜ invoke name=...>``,
                  ``<｜DSML｜ parameter name=...>`` (a space after the DSML token)

A call's arguments are its parameters: ``string="true"`` values are the text as it
stands (a JSON string in the OpenAI arguments), ``string="false"`` values are JSON.
``DsmlStreamParser`` turns them into an OpenAI arguments object as they stream.

For every format, text before the calls block (and after it) is content; a DSML
block's leading whitespace (the blank line that separates it from the reply) is not.

What belongs here: the formats and the text-level parsers. What does not: which
request gets tools, the OpenAI shapes (chat.py), the reasoning split (reasoning.py).
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
DSML = "｜DSML｜"

# OpenAI's limit on function names; a longer header than this cannot be a call.
MAX_NAME_LEN = 64
# The most whitespace characters in a row a forced call's arguments may hold: enough for
# pretty-printed JSON several levels deep, and a bound on how long a weak model can
# drift before the grammar makes it write the next token of the document.
MAX_ARGUMENT_WHITESPACE = 8
# The longest DSML parameter header (``NAME" string="true|false"``) the parser waits for
# the closing ">" of: a longer one is not a parameter, and holding it back would stall
# the stream.
MAX_PARAMETER_HEADER = 256


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallFormat(ABC):
    """One DeepSeek tool-call format (see the module doc); ``name`` is its
    ``--tool-call-parser`` value."""

    name: str

    @property
    @abstractmethod
    def markers(self) -> tuple[str, ...]:
        """The vocabulary pieces this format writes that a vocabulary may hold as special
        tokens (which decoding drops unless asked to keep them)."""

    @abstractmethod
    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """A whole calls block from (name, arguments JSON) pairs, as the model writes it
        after its content. ValueError (naming ``function.arguments``) for arguments the
        format cannot write."""

    @abstractmethod
    def render_tool_outputs(self, outputs: Sequence[str]) -> list[str]:
        """The contents of a run of ``tool`` messages (the results of one assistant
        turn's calls, in order) as the format writes tool results."""

    @abstractmethod
    def tools_prompt(self, functions: Sequence[dict[str, Any]]) -> str:
        """The tool section of a system prompt, for chat templates that do not render
        tools themselves. ``functions`` are OpenAI function definitions (name,
        description, parameters)."""

    @abstractmethod
    def calls_format(self, functions: Sequence[tuple[str, dict[str, Any]]], *,
                     parallel: bool) -> dict[str, Any]:
        """An xgrammar structural-tag format whose language is a calls block of one or more
        (only one unless ``parallel``) calls to ``functions`` ((name, parameters schema)
        pairs), each call's arguments satisfying its schema."""

    @abstractmethod
    def stream_parser(self, max_calls: int | None = None) -> ToolCallParser:
        """A parser for one output in this format (see ``ToolCallParser``)."""


@dataclass(frozen=True)
class TokenCallFormat(ToolCallFormat):
    """A format written with the vocabulary's tool tokens (deepseek_v3, deepseek_v31)."""

    name: str
    header_prefix: str       # after call-begin, before the function name
    header_suffix: str       # between the name and the arguments
    args_end: str            # after the arguments (ends the call)
    separator: str           # between two calls

    @property
    def markers(self) -> tuple[str, ...]:
        return CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, TOOL_SEP

    def render_call(self, name: str, arguments: str) -> str:
        return CALL_BEGIN + self.header_prefix + name + self.header_suffix + arguments + self.args_end

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        return CALLS_BEGIN + self.separator.join(self.render_call(n, a) for n, a in calls) + CALLS_END

    def render_tool_outputs(self, outputs: Sequence[str]) -> list[str]:
        return [OUTPUT_BEGIN + o + OUTPUT_END for o in outputs]

    def tools_prompt(self, functions: Sequence[dict[str, Any]]) -> str:
        """The layout of DeepSeek-V3.1's chat template."""
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
        tags = [{"type": "tag", "begin": CALL_BEGIN + self.header_prefix + name + self.header_suffix,
                 "content": {"type": "json_schema", "json_schema": schema,
                             "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE},
                 "end": self.args_end} for name, schema in functions]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": self.separator,
                 "at_least_one": True, "stop_after_first": not parallel}
        return {"type": "tag", "begin": CALLS_BEGIN, "content": calls, "end": CALLS_END}

    def stream_parser(self, max_calls: int | None = None) -> ToolCallStreamParser:
        return ToolCallStreamParser(self, max_calls)


@dataclass(frozen=True)
class DsmlFormat(ToolCallFormat):
    """A DSML format (deepseek_v32, deepseek_v4, deepseek_v41): the three tag names
    differ, the layout is DeepSeek's chat encoding of each model."""

    name: str
    block: str                  # the calls block's tag name
    invoke: str                 # a call's tag name
    parameter: str              # a parameter's tag name
    result: str                 # the tag around one tool result
    results: str | None         # the tag around a turn's results (V3.2), if any
    xgrammar_template: str      # xgrammar's builtin structural tag of this format

    @property
    def calls_begin(self) -> str:
        return f"<{DSML}{self.block}>"

    @property
    def calls_end(self) -> str:
        return f"</{DSML}{self.block}>"

    @property
    def invoke_begin(self) -> str:
        """Up to the call's name (which a '">' closes)."""
        return f'<{DSML}{self.invoke} name="'

    @property
    def invoke_end(self) -> str:
        return f"</{DSML}{self.invoke}>"

    @property
    def parameter_begin(self) -> str:
        """Up to the parameter's name (then '" string="true|false">')."""
        return f'<{DSML}{self.parameter} name="'

    @property
    def parameter_end(self) -> str:
        return f"</{DSML}{self.parameter}>"

    @property
    def markers(self) -> tuple[str, ...]:
        return (DSML,)

    def render_invoke(self, name: str, arguments: str) -> str:
        """One call: a string argument as its text with ``string="true"``, any other as
        JSON with ``string="false"``."""
        try:
            args = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise ValueError(f"function.arguments of the call to {name!r} is not JSON: {exc}") from None
        if not isinstance(args, dict):
            raise ValueError(f"function.arguments of the call to {name!r} must be a JSON object, "
                             f"not {type(args).__name__}")
        params = [f'{self.parameter_begin}{key}" string="{str(isinstance(v, str)).lower()}">'
                  f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}{self.parameter_end}"
                  for key, v in args.items()]
        return self.invoke_begin + name + '">\n' + "\n".join(params) + "\n" + self.invoke_end

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        # A blank line parts the block from the reply's text, as the model writes it.
        invokes = "\n".join(self.render_invoke(n, a) for n, a in calls)
        return "\n\n" + self.calls_begin + "\n" + invokes + "\n" + self.calls_end

    def render_tool_outputs(self, outputs: Sequence[str]) -> list[str]:
        wrapped = [f"<{self.result}>{o}</{self.result}>" for o in outputs]
        if self.results is not None and wrapped:
            wrapped[0] = f"<{self.results}>\n" + wrapped[0]
            wrapped[-1] += f"\n</{self.results}>"
        return wrapped

    def tools_prompt(self, functions: Sequence[dict[str, Any]]) -> str:
        """How to write a calls block (an example in this format's tags), the rule for
        the string attribute, and each function's definition as one line of JSON, as
        DeepSeek's chat encodings lay out their tool section."""
        example = "\n".join([
            self.calls_begin,
            self.invoke_begin + '$TOOL_NAME">',
            self.parameter_begin + '$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE' + self.parameter_end,
            "...",
            self.invoke_end,
            self.invoke_begin + '$TOOL_NAME2">',
            "...",
            self.invoke_end,
            self.calls_end])
        schemas = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
        return (f'## Tools\n\nYou can call the tools below. To call tools, write a "{self.calls_begin}" '
                f"block like this one:\n\n{example}\n\nWrite a string parameter's value as it is and set "
                'string="true"; write any other value (a number, boolean, array, object or null) as JSON '
                'and set string="false".\n\n### Available Tool Schemas\n\n'
                f"{schemas}\n\nCall only these tools, by their exact names, with parameters that follow "
                "their schemas.\n")

    def calls_format(self, functions: Sequence[tuple[str, dict[str, Any]]], *,
                     parallel: bool) -> dict[str, Any]:
        """xgrammar's builtin structural tag of this format (tool_choice "required" over
        ``functions``, without its reasoning part: the server adds its own): the blank
        line, the block, each call's parameters in the XML style of the format with
        values under the schema."""
        # Imported here: importing xgrammar takes seconds, and only forced calls need it.
        from xgrammar.builtin_structural_tag import get_model_structural_tag

        tools = [{"type": "function", "function": {"name": name, "parameters": schema}}
                 for name, schema in functions]
        tag = get_model_structural_tag(self.xgrammar_template, tools=tools, tool_choice="required",
                                       reasoning="disabled", max_whitespace_cnt=MAX_ARGUMENT_WHITESPACE,
                                       parallel_tool_calls=parallel)
        return tag.format.model_dump(mode="json")

    def stream_parser(self, max_calls: int | None = None) -> DsmlStreamParser:
        return DsmlStreamParser(self, max_calls)


TOOL_CALL_FORMATS: dict[str, ToolCallFormat] = {
    "deepseek_v3": TokenCallFormat("deepseek_v3", header_prefix="function" + TOOL_SEP,
                                   header_suffix="\n```json\n", args_end="\n```" + CALL_END, separator="\n"),
    "deepseek_v31": TokenCallFormat("deepseek_v31", header_prefix="", header_suffix=TOOL_SEP,
                                    args_end=CALL_END, separator=""),
    "deepseek_v32": DsmlFormat("deepseek_v32", block="function_calls", invoke="invoke", parameter="parameter",
                               result="result", results="function_results", xgrammar_template="deepseek_v3_2"),
    "deepseek_v4": DsmlFormat("deepseek_v4", block="tool_calls", invoke="invoke", parameter="parameter",
                              result="tool_result", results=None, xgrammar_template="deepseek_v4"),
    "deepseek_v41": DsmlFormat("deepseek_v41", block=" calls", invoke=" invoke", parameter=" parameter",
                               result="tool_result", results=None, xgrammar_template="deepseek_v4_1"),
}

# The DSML format of each model that writes one, by config.json's ``model_type`` and by
# its architecture (``architectures[0]``).
_MODEL_FORMATS = {
    "deepseek_v32": "deepseek_v32", "DeepseekV32ForCausalLM": "deepseek_v32",
    "deepseek_v4": "deepseek_v4", "DeepseekV4ForCausalLM": "deepseek_v4",
    "deepseek_v41": "deepseek_v41", "DeepseekV41ForCausalLM": "deepseek_v41",
}


def get_tool_call_format(name: str) -> ToolCallFormat:
    if name not in TOOL_CALL_FORMATS:
        raise ValueError(f"tool call parser {name!r} is not known; known: {', '.join(sorted(TOOL_CALL_FORMATS))}")
    return TOOL_CALL_FORMATS[name]


def default_tool_call_parser(hf_config: dict[str, Any]) -> str:
    """The ``--tool-call-parser`` a server over this checkpoint uses when none is given:
    the model's DSML format for DeepSeek-V3.2, V4 and V4.1 (by ``model_type``, else by
    architecture), ``deepseek_v3`` for any other model."""
    for key in (hf_config.get("model_type"), (hf_config.get("architectures") or [None])[0]):
        if key in _MODEL_FORMATS:
            return _MODEL_FORMATS[key]
    return "deepseek_v3"


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


_TEXT = "text"


class ToolCallParser(ABC):
    """Splits one output's text into content and tool calls as it arrives.

    ``feed`` takes the next piece of text and returns, in order, content strings and
    ``ToolCallDelta`` pieces; ``finish`` returns what was held back. Text that may be
    the start of a marker is held back until the next piece decides it, so a marker
    split across tokens is never streamed as content. A calls block that turns out not
    to follow the format is given back as content from the end of its last complete
    call on. A block may end without its end marker once a call is complete (a model
    that stops right after its last call). Calls beyond ``max_calls`` are parsed but
    not reported.
    """

    def __init__(self, max_calls: int | None = None) -> None:
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

    @abstractmethod
    def finish(self) -> list[str | ToolCallDelta]:
        """The held-back text, as content or as the rest of an unfinished call."""

    @abstractmethod
    def _step(self, out: list[str | ToolCallDelta]) -> bool:
        """Consume what the buffer decides; True if the state changed (step again)."""

    @property
    def malformed(self) -> bool:
        """True if a calls block did not follow the format, or a call is unfinished."""
        return self._malformed or any(not c.complete for c in self.calls)

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

    def _new_call(self, out: list[str | ToolCallDelta], name: str) -> None:
        self.calls.append(ParsedToolCall(id=make_tool_call_id(), name=name))
        if self._reported(len(self.calls) - 1):
            out.append(ToolCallDelta(index=len(self.calls) - 1, id=self.calls[-1].id, name=name))

    def _add_args(self, out: list[str | ToolCallDelta], text: str) -> None:
        """``text`` continues the last call's arguments."""
        if not text:
            return
        self.calls[-1].arguments += text
        if self._reported(len(self.calls) - 1):
            out.append(ToolCallDelta(index=len(self.calls) - 1, arguments=text))

    def _reported(self, index: int) -> bool:
        return self.max_calls is None or index < self.max_calls


_BETWEEN, _HEADER, _ARGS = "between", "header", "args"


class ToolCallStreamParser(ToolCallParser):
    """The parser of the token formats. Malformed: an unexpected character between
    calls, a header that is not "prefix NAME suffix" (a name of at most 64 characters
    without whitespace)."""

    def __init__(self, fmt: TokenCallFormat, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.fmt = fmt

    def finish(self) -> list[str | ToolCallDelta]:
        """Content, the rest of an unfinished call's arguments, or (for a block cut short
        before a call's arguments began) the block as content."""
        out: list[str | ToolCallDelta] = []
        if self._state == _TEXT:
            self._emit_text(out, self._buf)
        elif self._state == _ARGS:
            self._emit_args(out, self._buf)
        elif not (self._state == _BETWEEN and self._raw == "" and CALLS_END.startswith(self._buf.strip())):
            self._give_back(out)
        self._buf = ""
        return out

    def _step(self, out: list[str | ToolCallDelta]) -> bool:
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
            self._new_call(out, name)
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

    def _emit_args(self, out: list[str | ToolCallDelta], text: str) -> None:
        """Arguments text as the model wrote it (it is also the block's raw text)."""
        self._raw += text
        self._add_args(out, text)


_BLOCK, _INVOKE, _PARAMS, _PARAM, _VALUE = "block", "invoke", "params", "param", "value"
# A parameter header after its name's opening quote.
_PARAMETER_HEADER = re.compile(r'([^"]+)"\s+string="(true|false)"\s*')


class DsmlStreamParser(ToolCallParser):
    """The parser of the DSML formats. Each call's arguments are written as a JSON
    object while its parameters stream: ``{"KEY": `` when a parameter opens, a string
    value's text JSON-escaped as it comes, a non-string value once its closing tag shows
    it is JSON (it is held back until then), ``}`` when the call closes.

    Malformed: anything but whitespace between the tags, a call name that is empty,
    over 64 characters or holds whitespace or a quote, a parameter header that is not
    ``NAME" string="true|false">``, a parameter named twice in a call, a ``string="false"``
    value that is not JSON (NaN and Infinity included).
    """

    def __init__(self, fmt: DsmlFormat, max_calls: int | None = None) -> None:
        super().__init__(max_calls)
        self.fmt = fmt
        self._keys: list[str] = []      # the open call's parameter names so far
        self._string = False            # whether the open parameter's value is a string
        self._value = ""                # the open non-string value so far

    def finish(self) -> list[str | ToolCallDelta]:
        """Content (but not the whitespace that ends an output after its calls); the rest
        of an open string value (an unfinished call, already announced, keeps what it
        has); or a block cut short before its first call, or inside a call's name, as
        content."""
        out: list[str | ToolCallDelta] = []
        if self._state == _TEXT:
            if not (self.calls and self._buf.isspace()):
                self._emit_text(out, self._buf)
        elif self._state == _VALUE and self._string:
            self._add_args(out, _json_string_body(self._buf))
        elif self._state in (_BLOCK, _INVOKE) and not (
                self._state == _BLOCK and self._raw == "" and self.fmt.calls_end.startswith(self._buf.strip())):
            self._give_back(out)
        self._buf = ""
        return out

    def _step(self, out: list[str | ToolCallDelta]) -> bool:
        fmt, buf = self.fmt, self._buf
        if self._state == _TEXT:
            i = buf.find(fmt.calls_begin)
            # Whitespace is held back with a possible marker start: the blank line before
            # a block is not content.
            end = i if i >= 0 else len(buf) - partial_marker(buf, fmt.calls_begin)
            text = buf[:end].rstrip()
            self._emit_text(out, text)
            self._buf = buf[len(text):]
            if i < 0:
                return False
            self._raw = ""
            self._consume(i - len(text) + len(fmt.calls_begin))
            self._state = _BLOCK
            return True
        if self._state == _BLOCK:
            marker = self._match(fmt.invoke_begin, fmt.calls_end)
            if marker == fmt.invoke_begin:
                self._state = _INVOKE
            elif marker == fmt.calls_end:
                self._raw = ""
                self._state = _TEXT
            elif marker is None:
                self._give_back(out)
            return marker != ""
        if self._state == _INVOKE:
            j = buf.find('">')
            name = buf[:j] if j >= 0 else buf[:len(buf) - partial_marker(buf, '">')]
            if len(name) > MAX_NAME_LEN or '"' in name or any(ch.isspace() for ch in name) or j == 0:
                self._give_back(out)
                return True
            if j < 0:
                return False
            self._consume(j + 2)
            self._new_call(out, name)
            self._keys = []
            self._state = _PARAMS
            return True
        if self._state == _PARAMS:
            marker = self._match(fmt.parameter_begin, fmt.invoke_end)
            if marker == fmt.parameter_begin:
                self._state = _PARAM
            elif marker == fmt.invoke_end:
                self._add_args(out, "}" if self._keys else "{}")
                self.calls[-1].complete = True
                self._raw = ""
                self._state = _BLOCK
            elif marker is None:
                self._give_back(out)
            return marker != ""
        if self._state == _PARAM:
            j = buf.find(">")
            header = _PARAMETER_HEADER.fullmatch(buf[:j]) if j >= 0 else None
            if j < 0 and len(buf) <= MAX_PARAMETER_HEADER:
                return False
            if header is None or header.group(1) in self._keys:
                self._give_back(out)
                return True
            self._consume(j + 1)
            key, self._string, self._value = header.group(1), header.group(2) == "true", ""
            self._add_args(out, ", " if self._keys else "{")
            self._add_args(out, json.dumps(key, ensure_ascii=False) + ": " + ('"' if self._string else ""))
            self._keys.append(key)
            self._state = _VALUE
            return True
        # _VALUE
        k = buf.find(fmt.parameter_end)
        piece = self._consume(k if k >= 0 else len(buf) - partial_marker(buf, fmt.parameter_end))
        if self._string:
            self._add_args(out, _json_string_body(piece))
        else:
            self._value += piece
        if k < 0:
            return False
        self._consume(len(fmt.parameter_end))
        if self._string:
            self._add_args(out, '"')
        elif _is_json(self._value):
            self._add_args(out, self._value.strip())
        else:
            self._give_back(out)
            return True
        self._state = _PARAMS
        return True

    def _match(self, *markers: str) -> str | None:
        """After whitespace, the marker the buffer starts with (consumed with the
        whitespace); "" while the buffer may still become one, None if it cannot."""
        rest = self._buf.lstrip()
        for marker in markers:
            if rest.startswith(marker):
                self._consume(len(self._buf) - len(rest) + len(marker))
                return marker
        return "" if any(m.startswith(rest) for m in markers) else None

    def _consume(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._raw += taken
        return taken


def _json_string_body(text: str) -> str:
    """``text`` JSON-escaped, without the quotes (escaping is per character, so pieces
    escape alone)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _is_json(text: str) -> bool:
    try:
        json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return False
    return True


@dataclass
class ParsedToolOutput:
    """A whole output split into content (None when empty) and tool calls."""

    content: str | None
    calls: list[ParsedToolCall]


def parse_tool_calls(fmt: ToolCallFormat, text: str, max_calls: int | None = None) -> ParsedToolOutput:
    """The tool calls in a whole output. Calls are returned only if the block follows the
    format, every call is complete and every call's arguments are a JSON object; otherwise
    the whole text is content (as a model that wrote a broken call gave no call)."""
    parser = fmt.stream_parser(max_calls)
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
