"""POST /v1/completions: prompts in, text (streamed or whole) out.

A request with several prompts becomes one engine request per prompt; with
``n`` sequences each, choice ``i * n + j`` is prompt i's sequence j. ``echo``
prepends the prompt (and, with ``logprobs``, its prompt logprobs: the shape
lm-evaluation-harness reads for loglikelihood). Output constraints
(``response_format``, ``structured_outputs``, ``guided_*``) work as on chat.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deepinfer.entrypoints.openai.protocol import (CompletionChoice, CompletionRequest, CompletionResponse,
                                                   PromptLogprob, UsageInfo)
from deepinfer.entrypoints.openai.serving import (SSE_DONE, APIError, EngineStreamingResponse, ServerState,
                                                  Submission, build_sampling_params, check_fields,
                                                  clamp_logprob, completion_logprobs, output_constraint,
                                                  output_error, sse, stream_error, submit, unless_disconnected)
from deepinfer.outputs import RequestOutput

_FIELDS = list(CompletionRequest.model_fields)


@dataclass
class _Prompt:
    """One prompt: its token ids and the text ``echo`` returns."""

    ids: list[int]
    text: str


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request) -> Response:
    state.check_model(req.model)
    check_fields(req)
    n = req.n or 1
    structured, structured_field = output_constraint(req)
    prompts = _prompts(state, req)
    state.check_length([p.ids for p in prompts], req.max_tokens, "max_tokens")
    echo_logprobs = bool(req.echo) and req.logprobs is not None
    # The engine names the grammar it could not compile after SamplingParams' field.
    rename = {"structured_outputs": structured_field} if structured_field is not None else None
    params = build_sampling_params(
        req, max_tokens=req.max_tokens, logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if echo_logprobs else req.prompt_logprobs,
        structured=structured, rename=rename)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    sub = await submit(state.engine, request_id, [p.ids for p in prompts], params, _FIELDS, rename)
    if req.stream:
        return EngineStreamingResponse(_stream(state, req, request_id, prompts, n, sub), sub)
    try:
        finals = await unless_disconnected(raw, sub.final_outputs())
    finally:
        sub.abort_unfinished()
    if finals is None:     # the client went away; nobody reads this
        return Response(status_code=499)
    choices = []
    for i, (prompt, out) in enumerate(zip(prompts, finals)):
        error = output_error(out)
        if error is not None:
            raise APIError(500, f"generation failed: {error}")
        for c in out.outputs:
            choices.append(_choice(state, req, prompt, out, i * n + c.index, c.index, len(c.token_ids),
                                   c.text, first=True, finished=True))
    completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
    prompt_tokens = sum(len(p.ids) for p in prompts)
    usage = UsageInfo.of(prompt_tokens, completion_tokens, sum(out.num_cached_tokens for out in finals))
    resp = CompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=usage)
    return JSONResponse(resp.model_dump(mode="json"))


def completion_prompt_ids(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """The token ids ``create_completion`` gives the engine for ``req``, one list per prompt
    (prefill/decode disaggregation: the prefill instance computes exactly these)."""
    state.check_model(req.model)
    return [p.ids for p in _prompts(state, req)]


def _prompts(state: ServerState, req: CompletionRequest) -> list[_Prompt]:
    p = req.prompt
    add_special = req.add_special_tokens is not False
    if isinstance(p, str):
        texts: list[str] | None = [p]
    elif p and isinstance(p[0], str):
        texts = list(p)     # type: ignore[arg-type]
    else:
        texts = None
    if texts is not None:
        return [_Prompt(state.tokenizer.encode(t, add_special_tokens=add_special), t) for t in texts]
    if not p:
        raise APIError(400, "prompt is empty: give a string, a list of strings, token ids or a list of "
                            "token-id lists", param="prompt")
    batches = [p] if isinstance(p[0], int) else p
    prompts = []
    for ids in batches:
        ids = list(ids)     # type: ignore[arg-type]
        bad = [t for t in ids if not 0 <= t < state.vocab_size]
        # Checked here too (the engine would refuse it) because echo decodes the prompt first.
        if bad:
            raise APIError(400, f"prompt token id {bad[0]} is out of range [0, {state.vocab_size})",
                           param="prompt")
        prompts.append(_Prompt(ids, state.tokenizer.decode(ids, skip_special_tokens=False)))
    return prompts


def _choice(state: ServerState, req: CompletionRequest, prompt: _Prompt, out: RequestOutput, index: int,
            seq: int, num_tokens_to: int, text: str, *, first: bool, finished: bool,
            num_tokens_from: int = 0) -> CompletionChoice:
    """Choice ``index`` with ``text`` and the logprobs of generated tokens
    [num_tokens_from, num_tokens_to); a sequence's first choice also carries the
    prompt (``echo``) and its prompt logprobs."""
    c = out.outputs[seq]
    logprobs = None
    if req.logprobs is not None:
        ids = c.token_ids[num_tokens_from:num_tokens_to]
        entries: list = list((c.logprobs or [])[num_tokens_from:num_tokens_to])
        if req.echo and first:
            ids = out.prompt_token_ids + ids
            entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) + entries
        logprobs = completion_logprobs(state.tokenizer, ids, entries)
    if req.echo and first:
        text = prompt.text + text
    prompt_logprobs = None
    if req.prompt_logprobs is not None and first and out.prompt_logprobs is not None:
        prompt_logprobs = [None if e is None else {
            tok: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                               decoded_token=lp.decoded_token)
            for tok, lp in e.items()} for e in out.prompt_logprobs]
    return CompletionChoice(index=index, text=text, logprobs=logprobs,
                            finish_reason=c.finish_reason if finished else None,
                            stop_reason=c.stop_reason if finished else None,
                            prompt_logprobs=prompt_logprobs)


async def _stream(state: ServerState, req: CompletionRequest, request_id: str, prompts: list[_Prompt],
                  n: int, sub: Submission) -> AsyncIterator[str]:
    created = int(time.time())
    sent = [[0] * n for _ in prompts]          # tokens already streamed, per choice
    started = [[False] * n for _ in prompts]
    completion_tokens = 0
    cached: dict[int, int] = {}       # prompt index -> its prompt tokens served by the prefix cache
    try:
        async for i, out in sub.outputs():
            error = output_error(out)
            if error is not None:
                yield stream_error(APIError(500, f"generation failed: {error}"))
                break
            cached[i] = out.num_cached_tokens
            choices = []
            for c in out.outputs:
                j = c.index
                new_tokens = len(c.token_ids) - sent[i][j]
                finished = c.finish_reason is not None
                if not (c.delta_text or finished or (req.logprobs is not None and new_tokens)
                        or (req.echo and not started[i][j])):
                    continue
                choices.append(_choice(state, req, prompts[i], out, i * n + j, j, len(c.token_ids),
                                       c.delta_text, first=not started[i][j], finished=finished,
                                       num_tokens_from=sent[i][j]))
                started[i][j] = True
                sent[i][j] = len(c.token_ids)
                if finished:
                    completion_tokens += len(c.token_ids)
            if choices:
                yield sse(CompletionResponse(id=request_id, created=created, model=state.model_name,
                                             choices=choices))
        else:
            if req.stream_options is not None and req.stream_options.include_usage:
                prompt_tokens = sum(len(p.ids) for p in prompts)
                yield sse(CompletionResponse(
                    id=request_id, created=created, model=state.model_name, choices=[],
                    usage=UsageInfo.of(prompt_tokens, completion_tokens, sum(cached.values()))))
    except Exception as exc:    # reported in-band: the status line has already gone out
        yield stream_error(exc)
    yield SSE_DONE
