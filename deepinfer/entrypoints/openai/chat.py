"""POST /v1/chat/completions: a conversation rendered with the checkpoint's chat
template, then generated like a completion.

``response_format`` maps to structured outputs (``json_object`` -> any JSON
object, ``json_schema`` -> that schema). Without ``max_completion_tokens`` /
``max_tokens`` a reply may run to the model's context length, as in vLLM.
"""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepinfer.entrypoints.openai.protocol import (AssistantMessage, ChatChoice, ChatCompletionChunk,
                                                   ChatCompletionRequest, ChatCompletionResponse,
                                                   ChatLogprobs, ChatStreamChoice, DeltaMessage, UsageInfo)
from deepinfer.entrypoints.openai.serving import (SSE_DONE, APIError, EngineStreamingResponse, ServerState,
                                                  Submission, build_sampling_params, chat_logprobs,
                                                  output_error, render_chat, request_structured_outputs, sse,
                                                  stream_error, structured_outputs_params, submit,
                                                  unless_disconnected)
from deepinfer.sampling_params import StructuredOutputsParams

_FIELDS = list(ChatCompletionRequest.model_fields)
# SamplingParams names that differ from the chat request's.
_RENAME = {"logprobs": "top_logprobs"}


def _structured(req: ChatCompletionRequest) -> StructuredOutputsParams | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return request_structured_outputs(req.structured_outputs)
    if req.structured_outputs is not None:
        raise APIError(400, "set either response_format or structured_outputs, not both",
                       param="response_format")
    if fmt.type == "json_object":
        return structured_outputs_params({"json_object": True}, "response_format")
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema",
                       param="response_format")
    return structured_outputs_params({"json": fmt.json_schema.json_schema}, "response_format")


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request) -> Response:
    state.check_model(req.model)
    if req.tools:
        raise APIError(400, "tool calling is not supported yet", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    length_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    structured = _structured(req)
    text = render_chat(state.tokenizer, req.messages, req.add_generation_prompt is not False,
                       req.chat_template_kwargs)
    ids = state.tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
    state.check_length([ids], max_tokens, length_field)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    rename = dict(_RENAME)
    if req.response_format is not None and req.response_format.type != "text":
        # The engine names the grammar it could not compile after SamplingParams' field.
        rename["structured_outputs"] = "response_format"
    params = build_sampling_params(req, max_tokens=max_tokens, logprobs=top_n, structured=structured,
                                   rename=rename)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    sub = await submit(state.engine, request_id, [ids], params, _FIELDS, rename)
    n = req.n or 1
    if req.stream:
        return EngineStreamingResponse(_stream(state, req, request_id, len(ids), n, top_n, sub), sub)
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
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=None if top_n is None else ChatLogprobs(
                              content=chat_logprobs(c.token_ids, c.logprobs or [], top_n)),
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
               for c in out.outputs]
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    resp = ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                                  total_tokens=len(ids) + completion_tokens))
    return JSONResponse(resp.model_dump(mode="json"))


async def _stream(state: ServerState, req: ChatCompletionRequest, request_id: str, num_prompt_tokens: int,
                  n: int, top_n: int | None, sub: Submission) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name,
                                       choices=choices, usage=usage))

    sent = [0] * n
    completion_tokens = 0
    try:
        # OpenAI opens every choice with the assistant role and empty content.
        yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=""))
                     for j in range(n)])
        async for _, out in sub.outputs():
            error = output_error(out)
            if error is not None:
                yield stream_error(APIError(500, f"generation failed: {error}"))
                break
            choices = []
            for c in out.outputs:
                new_ids = c.token_ids[sent[c.index]:]
                finished = c.finish_reason is not None
                if not (c.delta_text or finished or (top_n is not None and new_ids)):
                    continue
                logprobs = None
                if top_n is not None:
                    entries = (c.logprobs or [])[sent[c.index]:len(c.token_ids)]
                    logprobs = ChatLogprobs(content=chat_logprobs(new_ids, entries, top_n))
                choices.append(ChatStreamChoice(
                    index=c.index, delta=DeltaMessage(content=c.delta_text or None), logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason if finished else None))
                sent[c.index] = len(c.token_ids)
                if finished:
                    completion_tokens += len(c.token_ids)
            if choices:
                yield chunk(choices)
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], UsageInfo(prompt_tokens=num_prompt_tokens,
                                          completion_tokens=completion_tokens,
                                          total_tokens=num_prompt_tokens + completion_tokens))
    except Exception as exc:    # reported in-band: the status line has already gone out
        yield stream_error(exc)
    yield SSE_DONE
