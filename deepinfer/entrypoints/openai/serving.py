"""What the OpenAI routes share: errors, sampling parameters, chat rendering,
submission to the engine and the wait for its outputs, and logprob shapes.

Route-specific response building lives in completions.py and chat.py; HTTP
plumbing (app, middleware, routes) in api_server.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import re
from typing import Any, AsyncIterator, Awaitable, Sequence, TypeVar

import jinja2
import jinja2.meta
from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from deepinfer.engine.tokenizer import Tokenizer
from deepinfer.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError
from deepinfer.entrypoints.openai.protocol import (REFUSED_FIELDS, ChatMessage, CompletionLogprobs, ErrorInfo,
                                                   ErrorResponse, SamplingFields, TokenLogprob, TopLogprob)
from deepinfer.entrypoints.openai.reasoning import ReasoningParser
from deepinfer.entrypoints.openai.tool_parsers import ToolCallFormat, get_tool_call_format
from deepinfer.outputs import PositionLogprobs, RequestOutput
from deepinfer.sampling_params import SamplingParams, StructuredOutputsParams

T = TypeVar("T")

# JSON has no -inf; like vLLM, a token with zero probability reports this logprob.
_MIN_LOGPROB = -9999.0

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` body with this HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: int | str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None,
               code: int | str | None = None) -> dict[str, Any]:
    info = ErrorInfo(message=message, type=_ERROR_TYPES.get(status, "invalid_request_error"),
                     param=param, code=code if code is not None else status)
    return ErrorResponse(error=info).model_dump()


def bad_request(exc: Exception, fields: Sequence[str], rename: dict[str, str] | None = None) -> APIError:
    """A 400 for a ValueError from SamplingParams or the engine. Their messages open
    with the offending field's name, which becomes ``param`` when the request has it."""
    message = str(exc)
    match = re.match(r"(?:prompt\[\d+\]: )?([a-z_]+)", message)
    name = match.group(1) if match else None
    name = (rename or {}).get(name, name)
    return APIError(400, message, param=name if name in fields else None)


def sse(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# -- sampling parameters ---------------------------------------------------------------------------
def structured_outputs_params(spec: dict[str, Any], field_name: str) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**spec)``; a bad spec is a 400 naming ``field_name``. (A spec
    that is well formed but does not compile is refused by the engine when it is added.)"""
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as exc:
        raise APIError(400, f"{field_name}: {exc}", param=field_name) from exc


def build_sampling_params(req: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                          prompt_logprobs: int | None = None,
                          structured: StructuredOutputsParams | None = None,
                          rename: dict[str, str] | None = None) -> SamplingParams:
    """SamplingParams from the request's fields; an unset (None) field keeps
    SamplingParams' default. Bad values are a 400 naming the field."""
    logit_bias = None
    if req.logit_bias is not None:
        try:
            logit_bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError as exc:
            raise APIError(400, f"logit_bias keys must be token ids (integers as strings): {exc}",
                           param="logit_bias") from exc
    values = dict(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                  presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                  repetition_penalty=req.repetition_penalty, logit_bias=logit_bias, seed=req.seed,
                  stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                  min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  skip_special_tokens=req.skip_special_tokens,
                  include_stop_str_in_output=req.include_stop_str_in_output)
    # max_tokens=None is meaningful: generate up to max_model_len.
    kwargs = {k: v for k, v in values.items() if v is not None} | {"max_tokens": max_tokens}
    if structured is not None:
        kwargs["structured_outputs"] = structured
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        raise bad_request(exc, list(type(req).model_fields), rename) from exc


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def output_constraint(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The grammar a request asks for and the field that asks: ``response_format``
    (``json_object`` -> any JSON object, ``json_schema`` -> that schema; ``text`` asks
    for nothing), ``structured_outputs``, or one of vLLM's older ``guided_*`` fields.
    Two of them at once are a 400 naming both."""
    given = [name for name, value in (("response_format", req.response_format), *(
        (name, getattr(req, name)) for name in ("structured_outputs", *_GUIDED)))
        if value is not None and not (name == "response_format" and value.type == "text")]
    if len(given) > 1:
        raise APIError(400, f"{' and '.join(given)} each constrain the output: set one of them, not both",
                       param=given[1])
    if not given:
        return None, None
    field = given[0]
    if field == "response_format":
        fmt = req.response_format
        if fmt.type == "json_object":
            return structured_outputs_params({"json_object": True}, field), field
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema", param=field)
        return structured_outputs_params({"json": fmt.json_schema.json_schema}, field), field
    if field == "structured_outputs":
        return structured_outputs_params(req.structured_outputs.as_kwargs(), field), field
    return structured_outputs_params({_GUIDED[field]: getattr(req, field)}, field), field


def check_fields(req: BaseModel) -> None:
    """A 400 naming the first field the request sets that this server refuses (see
    protocol.REFUSED_FIELDS; ``best_of`` equal to ``n`` and ``modalities`` of text only
    are accepted), or ``stream_options`` without ``stream``."""
    name = type(req).__name__
    for key, instead in REFUSED_FIELDS.items():
        model, field = key.split(".")
        value = getattr(req, field) if model == name else None
        neutral = ((field == "best_of" and value == (getattr(req, "n", None) or 1))
                   or (field == "modalities" and value == ["text"]))
        if value is not None and not neutral:
            raise APIError(400, f"{field}={json.dumps(value, default=str)}: {instead}", param=field)
    if getattr(req, "stream_options", None) is not None and not getattr(req, "stream", False):
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")


def ignored_fields(model: BaseModel, path: str = "") -> list[str]:
    """Where the request has fields no model declares (dotted paths, list positions in
    brackets). A message's undeclared fields are template variables, not ignored."""
    found = [] if isinstance(model, ChatMessage) else [f"{path}{k}" for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                where = f"{path}{name}[{i}]." if isinstance(value, list) else f"{path}{name}."
                found += ignored_fields(item, where)
    return found


# -- chat rendering ------------------------------------------------------------------------------
def render_chat(tokenizer: Tokenizer, messages: Sequence[ChatMessage], add_generation_prompt: bool,
                chat_template_kwargs: dict[str, Any] | None, *, tools: list[dict[str, Any]] | None = None,
                tool_format: ToolCallFormat | None = None) -> str:
    """The conversation rendered with the checkpoint's chat template. Content parts
    must be text; they are joined with newlines, as vLLM does for string templates.

    Tools (OpenAI tool definitions) and tool calls go to the template as they are when
    it reads ``tools``: the checkpoint's template is the source of truth. A template
    without tool support gets them in DeepSeek's format (``tool_format``): the tool
    section joins the system message, an assistant message's calls follow its content,
    and a ``tool`` message's content is wrapped as the format writes tool results."""
    conversation = []
    for i, message in enumerate(messages):
        entry = {**(message.model_extra or {}), "role": message.role, "name": message.name,
                 "tool_call_id": message.tool_call_id, "reasoning_content": message.reasoning_content}
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}].content[{j}]: content parts of type {part.type!r} "
                                        "are not supported; only 'text' parts with a 'text' field",
                                   param="messages")
                texts.append(part.text)
            content = "\n".join(texts)
        entry["content"] = content
        if message.tool_calls:
            entry["tool_calls"] = [
                {"id": call.id or f"call_{i}_{j}", "type": call.type,
                 "function": {"name": call.function.name, "arguments": _arguments_text(call.function.arguments)}}
                for j, call in enumerate(message.tool_calls)]
        conversation.append(entry)
    kwargs = dict(chat_template_kwargs or {})
    if template_knows_tools(tokenizer.chat_template_source(with_tools=tools is not None)):
        kwargs["tools"] = tools
    elif tool_format is not None:
        conversation = _deepseek_tool_conversation(conversation, tools, tool_format)
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, **kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise APIError(400, f"cannot render the chat template: {exc}", param="messages") from exc


@functools.lru_cache(maxsize=8)
def template_knows_tools(source: str | None) -> bool:
    """Whether a chat template renders tools itself: it reads the ``tools`` variable or
    a message's ``tool_calls``."""
    if source is None:
        return False
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source)) or "tool_calls" in source


def _arguments_text(arguments: str | dict[str, Any]) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _deepseek_tool_conversation(conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                                fmt: ToolCallFormat) -> list[dict[str, Any]]:
    """The conversation with tools, calls and tool outputs written as DeepSeek's text (the
    messages keep their fields: the template may still read them). A run of ``tool``
    messages is one turn's results: the format may wrap the run as well as each one."""
    out: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []      # the run of tool messages being read

    def end_run() -> None:
        for entry, text in zip(outputs, fmt.render_tool_outputs([e.get("content") or "" for e in outputs])):
            entry["content"] = text
        outputs.clear()

    for i, entry in enumerate(conversation):
        entry = dict(entry)
        calls = entry.get("tool_calls")
        if calls:
            try:
                block = fmt.render_calls([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            except ValueError as exc:
                raise APIError(400, f"messages[{i}].tool_calls: {exc}", param=f"messages[{i}].tool_calls") from exc
            entry["content"] = (entry.get("content") or "") + block
        if entry["role"] == "tool":
            outputs.append(entry)
        else:
            end_run()
        out.append(entry)
    end_run()
    if tools:
        section = fmt.tools_prompt([t["function"] for t in tools])
        if out and out[0]["role"] == "system" and isinstance(out[0].get("content"), str):
            out[0]["content"] = out[0]["content"] + "\n\n" + section
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


# -- per-server state ------------------------------------------------------------------------------
@dataclasses.dataclass
class ServerState:
    """What the route handlers share. ``tool_format`` is the ``--tool-call-parser``
    format (without the flag, the model's own: forced tool calls and templates without
    tool support still need one; see ``default_tool_call_parser``); ``auto_tool_choice`` says whether the model may
    choose to call tools (``--enable-auto-tool-choice``); ``reasoning`` is the
    ``--reasoning-parser``, if any."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_names: list[str]
    max_model_len: int
    vocab_size: int
    tool_format: ToolCallFormat = dataclasses.field(default_factory=lambda: get_tool_call_format("deepseek_v3"))
    auto_tool_choice: bool = False
    reasoning: ReasoningParser | None = None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}.",
                           param="model", code="model_not_found")

    def check_length(self, prompts: Sequence[list[int]], max_tokens: int | None, field: str) -> None:
        """A 400 when a prompt plus the tokens asked for cannot fit in the model's context."""
        if max_tokens is None:
            return
        for ids in prompts:
            if len(ids) + max_tokens > self.max_model_len:
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. "
                                    f"However, you requested {len(ids) + max_tokens} tokens ({len(ids)} in "
                                    f"the prompt, {max_tokens} in the completion). Please reduce the length "
                                    f"of the prompt or {field}.",
                               param=field, code="context_length_exceeded")


# -- submission ------------------------------------------------------------------------------------
class Submission:
    """The engine requests behind one HTTP request (one per prompt) and their outputs."""

    def __init__(self, engine: AsyncEngine, base_id: str, num_prompts: int) -> None:
        self.engine = engine
        self.request_ids = [f"{base_id}-{i}" for i in range(num_prompts)]
        self.queue: asyncio.Queue = asyncio.Queue()
        self._done: set[str] = set()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) in arrival order until every request has finished."""
        index = {rid: i for i, rid in enumerate(self.request_ids)}
        while len(self._done) < len(self.request_ids):
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self._done.add(item.request_id)
            yield index[item.request_id], item

    async def final_outputs(self) -> list[RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in self.outputs():
            if out.finished:
                finals[i] = out
        return [finals[i] for i in range(len(self.request_ids))]

    def abort_unfinished(self) -> None:
        for rid in self.request_ids:
            if rid not in self._done:
                self._done.add(rid)
                self.engine.abort(rid)


async def submit(engine: AsyncEngine, base_id: str, prompts: Sequence[list[int]], params: SamplingParams,
                 fields: Sequence[str], rename: dict[str, str] | None = None) -> Submission:
    sub = Submission(engine, base_id, len(prompts))
    batch = [(rid, ids, params.clone()) for rid, ids in zip(sub.request_ids, prompts)]
    try:
        await engine.add_requests(batch, sub.queue)
    except ValueError as exc:
        raise bad_request(exc, fields, rename) from exc
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from exc
    return sub


def output_error(out: RequestOutput) -> str | None:
    """Why the engine failed this request, if it did."""
    if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
        return out.error or "internal error"
    return None


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however the response ends:
    completed, failed, or cancelled because the client went away (even before the
    body iterator first ran, when its own ``finally`` would never execute)."""

    def __init__(self, content: AsyncIterator[str], submission: Submission) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._submission = submission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._submission.abort_unfinished()


def stream_error(exc: BaseException) -> str:
    """The SSE event that reports a failure after the stream started."""
    status = exc.status if isinstance(exc, APIError) else 500
    message = exc.message if isinstance(exc, APIError) else str(exc)
    return sse(error_body(status, message))


async def unless_disconnected(raw: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``, cancelling it if the client disconnects first (then None)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
    return None if task.cancelled() else task.result()


async def _wait_for_disconnect(raw: Request) -> None:
    # The body has been read, so the next message is the disconnect.
    while (await raw.receive())["type"] != "http.disconnect":
        pass


# -- logprobs ------------------------------------------------------------------------------------
def clamp_logprob(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


def completion_logprobs(tokenizer: Tokenizer, token_ids: Sequence[int],
                        entries: Sequence[PositionLogprobs | None]) -> CompletionLogprobs:
    """The completions API's logprobs: one position per token; an entry of None (the
    first prompt token has no logprob) gives nulls. ``top_logprobs`` maps token text
    to logprob for the top-N plus the chosen token; ``text_offset`` counts from the
    first token given."""
    out = CompletionLogprobs()
    text_offset = 0
    for tok, entry in zip(token_ids, entries):
        if entry is None:
            text = tokenizer.id_to_token_text(tok)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            chosen = entry[tok]
            text = chosen.decoded_token or ""
            out.token_logprobs.append(clamp_logprob(chosen.logprob))
            out.top_logprobs.append({lp.decoded_token or "": clamp_logprob(lp.logprob)
                                     for lp in entry.values()})
        out.tokens.append(text)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[PositionLogprobs],
                  top_n: int) -> list[TokenLogprob]:
    """The chat API's logprobs content: the chosen token and the ``top_n`` most likely."""
    content = []
    for tok, entry in zip(token_ids, entries):
        chosen = entry[tok]
        best = sorted(entry.values(), key=lambda lp: lp.logprob, reverse=True)[:top_n]
        text = chosen.decoded_token or ""
        content.append(TokenLogprob(
            token=text, logprob=clamp_logprob(chosen.logprob), bytes=list(text.encode("utf-8")),
            top_logprobs=[TopLogprob(token=lp.decoded_token or "", logprob=clamp_logprob(lp.logprob),
                                     bytes=list((lp.decoded_token or "").encode("utf-8"))) for lp in best]))
    return content
