"""POST /v1/chat/completions: a conversation rendered with the checkpoint's chat
template, then generated like a completion; the output is split into reasoning,
content and tool calls.

Output constraints (``response_format``, ``structured_outputs``, ``guided_*``) work as
on /v1/completions. Without ``max_completion_tokens`` / ``max_tokens`` a reply may run
to the model's context length, as in vLLM.

Tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``): ``none`` sends no
tools; ``auto`` (the default with tools; needs ``--enable-auto-tool-choice``) lets
the model write calls in the ``--tool-call-parser`` format and parses what it wrote;
``required`` and a named function force a calls block with a grammar built from the
functions' schemas, so every call parses and its arguments satisfy the schema.
Calls come back as OpenAI ``tool_calls`` (arguments as JSON text, ids ``call_...``,
``finish_reason: "tool_calls"``), streamed as tool-call deltas.

Reasoning (``--reasoning-parser``): a thinking request's output before ``</think>``
is ``reasoning_content`` (streamed as its own deltas); tool calls and the content
come from the text after it. A grammar then starts after ``</think>``: the model
thinks freely, then answers in the constrained form.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepinfer.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                                   ChatCompletionRequest, ChatCompletionResponse,
                                                   ChatLogprobs, ChatStreamChoice, DeltaFunctionCall,
                                                   DeltaMessage, DeltaToolCall, FunctionCall, ToolCall,
                                                   UsageInfo)
from deepinfer.entrypoints.openai.reasoning import ReasoningStreamSplitter, split_reasoning
from deepinfer.entrypoints.openai.serving import (SSE_DONE, APIError, EngineStreamingResponse, ServerState,
                                                  Submission, build_sampling_params, chat_logprobs,
                                                  check_fields, output_constraint, output_error, render_chat,
                                                  sse, stream_error, structured_outputs_params, submit,
                                                  unless_disconnected)
from deepinfer.entrypoints.openai.tool_parsers import (ParsedToolCall, ToolCallDelta, ToolCallFormat,
                                                       parse_tool_calls)
from deepinfer.sampling_params import StructuredOutputsParams
from deepinfer.structured.json_schema import check_json_schema

_FIELDS = list(ChatCompletionRequest.model_fields)
# SamplingParams names that differ from the chat request's.
_RENAME = {"logprobs": "top_logprobs"}
# Function names: OpenAI's characters plus "." and ":" (namespaced tools), OpenAI's length.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# A function without parameters takes an empty object, as in OpenAI.
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class _Tools:
    """What a request's tools ask of this generation."""

    definitions: list[dict[str, Any]]           # OpenAI tool definitions, for the template
    choice: str                                 # auto | required | named
    forced: list[tuple[str, dict[str, Any]]]    # (name, schema) a forced block may call
    max_calls: int | None                       # 1 without parallel_tool_calls


def _tools(state: ServerState, req: ChatCompletionRequest) -> _Tools | None:
    """The request's tools after validation; None when the model gets none."""
    choice = req.tool_choice
    choice_text = choice if isinstance(choice, str) or choice is None else f"function {choice.function.name!r}"
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, f"tool_choice={choice_text} needs tools; the request has none", param="tool_choice")
        return None
    names: list[str] = []
    for i, tool in enumerate(req.tools):
        name = tool.function.name
        if not _FUNCTION_NAME.fullmatch(name):
            raise APIError(400, f"tools[{i}].function.name={name!r} must be 1 to 64 letters, digits, "
                                "'_', '-', '.' or ':'", param=f"tools[{i}].function.name")
        if name in names:
            raise APIError(400, f"tools[{i}].function.name={name!r} is defined twice",
                           param=f"tools[{i}].function.name")
        names.append(name)
    if choice == "none":
        return None
    definitions = [t.model_dump(exclude_none=True) for t in req.tools]
    max_calls = None if req.parallel_tool_calls is not False else 1
    if choice in (None, "auto"):
        if not state.auto_tool_choice:
            raise APIError(400, 'tool_choice="auto" (the default when tools are given) needs the server '
                                "started with --enable-auto-tool-choice and --tool-call-parser; or ask for "
                                'tool_choice="required", a named function, or "none"', param="tool_choice")
        return _Tools(definitions, "auto", [], max_calls)
    if choice == "required":
        picked = list(range(len(names)))
    else:
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not among "
                                f"the tools ({', '.join(names)})", param="tool_choice")
        picked = [names.index(choice.function.name)]
    forced = []
    for i in picked:
        schema = req.tools[i].function.parameters or _NO_PARAMETERS
        try:
            check_json_schema(schema)
        except ValueError as exc:
            message = str(exc).replace("structured_outputs.json", f"tools[{i}].function.parameters", 1)
            raise APIError(400, message, param=f"tools[{i}].function.parameters") from exc
        # A call's arguments are a JSON object: the parsers read nothing else back, and the
        # DSML formats write arguments as an object's parameters.
        if schema.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}].function.parameters must describe a JSON object (a call's "
                                f"arguments), not type {json.dumps(schema['type'])}",
                           param=f"tools[{i}].function.parameters")
        forced.append((names[i], schema))
    return _Tools(definitions, "required" if choice == "required" else "named", forced, max_calls)


def _constraint_format(params: StructuredOutputsParams, field: str) -> dict[str, Any]:
    """A request's output constraint as a structural-tag format, to follow a reasoning block."""
    kind = params.kind
    if params.disable_any_whitespace:
        raise APIError(400, f"{field}: disable_any_whitespace cannot be combined with thinking (the grammar "
                            "then starts after the reasoning block, where it is not available)", param=field)
    if kind == "json":
        schema = params.json if isinstance(params.json, dict) else json.loads(params.json)
        return {"type": "json_schema", "json_schema": schema}
    if kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if kind == "regex":
        return {"type": "regex", "pattern": params.regex}
    if kind == "grammar":
        return {"type": "grammar", "grammar": params.grammar}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in params.choice]}
    tag = params.structural_tag if isinstance(params.structural_tag, dict) else json.loads(params.structural_tag)
    if not isinstance(tag.get("format"), dict):
        raise APIError(400, f"{field}: a structural tag needs a \"format\" object", param=field)
    return tag["format"]


def _grammar(state: ServerState, tools: _Tools | None, thinking: bool,
             constraint: StructuredOutputsParams | None, field: str | None) -> StructuredOutputsParams | None:
    """The grammar of the generation: a forced calls block, or the request's constraint;
    after a free reasoning block when the request thinks."""
    if tools is not None and tools.forced:
        if constraint is not None:
            raise APIError(400, f"tool_choice ({tools.choice}) and {field} both constrain the output: set one",
                           param=field)
        fmt = state.tool_format.calls_format(tools.forced, parallel=tools.max_calls is None)
    elif constraint is None:
        return None
    elif not thinking:
        return constraint
    else:
        fmt = _constraint_format(constraint, field)
    if thinking:
        fmt = {"type": "sequence", "elements": [state.reasoning.grammar_prefix(), fmt]}
    return structured_outputs_params({"structural_tag": {"type": "structural_tag", "format": fmt}},
                                     field or "tool_choice")


def _markers_are_special(state: ServerState, markers: tuple[str, ...]) -> bool:
    """Whether the vocabulary holds any of ``markers`` as a special token (which decoding
    would drop unless asked to keep special tokens)."""
    tok = state.tokenizer
    for marker in markers:
        ids = tok.encode(marker, add_special_tokens=False)
        if len(ids) == 1 and ids[0] in tok.all_special_ids:
            return True
    return False


class _OutputParser:
    """Splits one choice's text into reasoning, content and tool calls, streamed (``feed``
    then ``finish``) or whole (``parse``)."""

    def __init__(self, fmt: ToolCallFormat, thinking: bool, include_reasoning: bool,
                 tools: _Tools | None) -> None:
        self.fmt = fmt
        self.thinking = thinking
        self.include_reasoning = include_reasoning
        self.tools = tools
        self._splitter = ReasoningStreamSplitter() if thinking else None
        self._calls = fmt.stream_parser(tools.max_calls) if tools is not None else None

    @property
    def called(self) -> bool:
        """Whether a complete tool call has been streamed."""
        return self._calls is not None and any(
            c.complete for c in self._calls.calls[:self._calls.max_calls])

    def feed(self, text: str) -> list[DeltaMessage]:
        if self._splitter is None:
            return self._deltas("", text, final=False)
        reasoning, content = self._splitter.feed(text)
        return self._deltas(reasoning, content, final=False)

    def finish(self) -> list[DeltaMessage]:
        reasoning, content = self._splitter.finish() if self._splitter is not None else ("", "")
        return self._deltas(reasoning, content, final=True)

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[DeltaMessage]:
        out = []
        if reasoning and self.include_reasoning:
            out.append(DeltaMessage(reasoning_content=reasoning))
        if self._calls is None:
            if content:
                out.append(DeltaMessage(content=content))
            return out
        pieces = self._calls.feed(content) if content else []
        if final:
            pieces += self._calls.finish()
        for piece in pieces:
            last = out[-1] if out else None
            if isinstance(piece, str):
                if last is not None and last.content is not None:
                    last.content += piece
                else:
                    out.append(DeltaMessage(content=piece))
                continue
            delta = _delta_tool_call(piece)
            if last is not None and last.tool_calls is not None:
                prev = last.tool_calls[-1]
                if prev.index == delta.index:       # the same call: one delta with both parts
                    prev.function.arguments = (prev.function.arguments or "") + (delta.function.arguments or "")
                else:
                    last.tool_calls.append(delta)
            else:
                out.append(DeltaMessage(tool_calls=[delta]))
        return out

    def parse(self, text: str) -> tuple[str | None, str | None, list[ParsedToolCall]]:
        """(reasoning, content, complete tool calls) of a whole output."""
        reasoning, content = split_reasoning(text) if self.thinking else (None, text)
        calls: list[ParsedToolCall] = []
        if self.tools is not None:
            parsed = parse_tool_calls(self.fmt, content or "", self.tools.max_calls)
            content, calls = parsed.content, parsed.calls
        return (reasoning if self.include_reasoning else None), content, calls


def _delta_tool_call(piece: ToolCallDelta) -> DeltaToolCall:
    if piece.id is not None:
        return DeltaToolCall(index=piece.index, id=piece.id, type="function",
                             function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))
    return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    return kwargs


def _prompt_ids(state: ServerState, req: ChatCompletionRequest, tools: _Tools | None,
                template_kwargs: dict[str, Any]) -> list[int]:
    text = render_chat(state.tokenizer, req.messages, req.add_generation_prompt is not False, template_kwargs,
                       tools=tools.definitions if tools is not None else None, tool_format=state.tool_format)
    return state.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))


def chat_prompt_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The token ids ``create_chat_completion`` gives the engine for ``req`` (prefill/decode
    disaggregation: the prefill instance computes exactly the prompt the decode one will)."""
    state.check_model(req.model)
    return _prompt_ids(state, req, _tools(state, req), _template_kwargs(req))


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    state.check_model(req.model)
    check_fields(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    length_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    tools = _tools(state, req)
    template_kwargs = _template_kwargs(req)
    thinking = state.reasoning is not None and state.reasoning.enabled(template_kwargs)
    constraint, constraint_field = output_constraint(req)
    grammar = _grammar(state, tools, thinking, constraint, constraint_field)
    ids = _prompt_ids(state, req, tools, template_kwargs)
    state.check_length([ids], max_tokens, length_field)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    rename = dict(_RENAME)
    if grammar is not None:
        # The engine names the grammar it could not compile after SamplingParams' field.
        rename["structured_outputs"] = constraint_field or "tools"
    params = build_sampling_params(req, max_tokens=max_tokens, logprobs=top_n, structured=grammar,
                                   rename=rename)
    markers = (state.tool_format.markers if tools is not None else ()) + (
        ("<think>", "</think>") if thinking else ())
    if req.skip_special_tokens is None and _markers_are_special(state, markers):
        params.skip_special_tokens = False     # the parsers read the markers back from the text
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    sub = await submit(state.engine, request_id, [ids], params, _FIELDS, rename)
    n = req.n or 1
    parsers = [_OutputParser(state.tool_format, thinking, req.include_reasoning is not False, tools)
               for _ in range(n)]
    if req.stream:
        return EngineStreamingResponse(_stream(state, req, request_id, len(ids), top_n, parsers, sub), sub)
    try:
        finals = await unless_disconnected(raw, sub.final_outputs())
    finally:
        sub.abort_unfinished()
    if finals is None:     # the client went away; nobody reads this
        return Response(status_code=499)
    out = finals[0]
    error = output_error(out)
    if error is not None:
        raise APIError(500, f"generation failed: {error}")
    choices = []
    for c in out.outputs:
        reasoning, content, calls = parsers[c.index].parse(c.text)
        message = AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=[
            ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in calls] or None)
        choices.append(ChatChoice(index=c.index, message=message,
                                  logprobs=None if top_n is None else ChatLogprobs(
                                      content=chat_logprobs(c.token_ids, c.logprobs or [], top_n)),
                                  finish_reason="tool_calls" if calls else c.finish_reason,
                                  stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    resp = ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=UsageInfo.of(len(ids), completion_tokens, out.num_cached_tokens))
    return JSONResponse(resp.model_dump(mode="json"))


async def _stream(state: ServerState, req: ChatCompletionRequest, request_id: str, num_prompt_tokens: int,
                  top_n: int | None, parsers: list[_OutputParser], sub: Submission) -> AsyncIterator[str]:
    created = int(time.time())
    n = len(parsers)

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name,
                                       choices=choices, usage=usage))

    sent = [0] * n
    completion_tokens = cached_tokens = 0
    opened = False
    try:
        async for _, out in sub.outputs():
            error = output_error(out)
            if error is not None:
                yield stream_error(APIError(500, f"generation failed: {error}"))
                break
            cached_tokens = out.num_cached_tokens
            if not opened:
                # OpenAI opens every choice with the assistant role and empty content. It goes
                # with the first output, as vLLM sends it, so that a client's time to first
                # chunk is the time to the first token, not to the request's admission.
                yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                             for j in range(n)])
                opened = True
            # One chunk holds at most one delta per choice; a step that yields several
            # (reasoning, then content, then a call) sends several chunks.
            rounds: list[list[ChatStreamChoice]] = []
            for c in out.outputs:
                new_ids = c.token_ids[sent[c.index]:]
                finished = c.finish_reason is not None
                if not (c.delta_text or finished or (top_n is not None and new_ids)):
                    continue
                parser = parsers[c.index]
                deltas = parser.feed(c.delta_text) if c.delta_text else []
                if finished:
                    deltas += parser.finish()
                if not deltas and (finished or (top_n is not None and new_ids)):
                    deltas = [DeltaMessage()]
                for k, delta in enumerate(deltas):
                    choice = ChatStreamChoice(index=c.index, delta=delta)
                    if k == 0 and top_n is not None:
                        entries = (c.logprobs or [])[sent[c.index]:len(c.token_ids)]
                        choice.logprobs = ChatLogprobs(content=chat_logprobs(new_ids, entries, top_n))
                    if k == len(deltas) - 1 and finished:
                        choice.finish_reason = "tool_calls" if parser.called else c.finish_reason
                        choice.stop_reason = c.stop_reason
                    if k == len(rounds):
                        rounds.append([])
                    rounds[k].append(choice)
                sent[c.index] = len(c.token_ids)
                if finished:
                    completion_tokens += len(c.token_ids)
            for choices in rounds:
                yield chunk(choices)
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], UsageInfo.of(num_prompt_tokens, completion_tokens, cached_tokens))
    except Exception as exc:    # reported in-band: the status line has already gone out
        yield stream_error(exc)
    yield SSE_DONE
