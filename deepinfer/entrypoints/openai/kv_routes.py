"""The routes of ``deepinfer serve --role prefill|decode`` (prefill/decode disaggregation).

What belongs here: the two internal endpoints the PD router (deepinfer/router/) calls
and their checks. What does not: the export format and the engine-side work
(engine/kv_transfer.py), the choice of instances (the router).

- ``--role prefill``: POST ``/kv/prefill/v1/completions`` and
  ``/kv/prefill/v1/chat/completions`` take the OpenAI request body the client sent, compute
  its prompts exactly as the OpenAI routes would (same chat template, tools, special
  tokens), greedily sample one token that nobody sees, then answer the prompts' KV blocks
  (``application/x-deepinfer-kv``, engine/kv_transfer.py). The request's own sampling
  fields do not matter here: the KV of a prompt does not depend on them.
  With the header ``X-DeepInfer-KV-Transfer: shared`` (the router's ``--kv-transfer
  shared``, prefill and decode instances on one host) the blocks go into a staging buffer
  (engine/kv_share.py: CUDA IPC, or shared memory on the CPU) and the answer carries its
  handle; the response header ``X-DeepInfer-KV-Share`` names it, and POST ``/kv/release``
  (JSON ``{"id", "opened"}``) frees it once the decode instance has imported it (or failed
  to). Buffers not released within ``SHARE_TTL_S`` are freed anyway.
- ``--role decode``: POST ``/kv/import`` takes such an export and puts its blocks into the
  host tier; JSON ``{"imported_blocks", "skipped_blocks", "opened", "bytes"}`` (``opened``:
  a shared export's buffer was mapped). An export of another model or cache layout is a
  409, an unusable share handle (another host, expired) a 400. The request itself then
  comes to ``/v1/...`` as to any server.
"""

from __future__ import annotations

import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deepinfer.engine import kv_transfer
from deepinfer.engine.kv_share import DEFAULT_TTL_S as SHARE_TTL_S
from deepinfer.engine.kv_share import ShareError, ShareRegistry
from deepinfer.entrypoints.openai.async_engine import EngineDeadError
from deepinfer.entrypoints.openai.chat import chat_prompt_ids
from deepinfer.entrypoints.openai.completions import completion_prompt_ids
from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from deepinfer.entrypoints.openai.serving import APIError, ServerState, output_error, submit, unless_disconnected
from deepinfer.sampling_params import SamplingParams

ROLES = ("prefill", "decode")

# What the prefill instance runs: the prompt, and one greedy token to end the request.
_PREFILL_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)

TRANSFER_HEADER = "X-DeepInfer-KV-Transfer"
SHARE_HEADER = "X-DeepInfer-KV-Share"
TRANSFERS = ("inline", "shared")


def check_role(role: str | None, kv_offload_bytes: int) -> None:
    """A role the server can play with its cache settings; ValueError naming the flag."""
    if role is None:
        return
    if role not in ROLES:
        raise ValueError(f"--role {role!r}: choose one of {', '.join(ROLES)}")
    if role == "decode" and kv_offload_bytes <= 0:
        raise ValueError("--role decode needs a host tier to import prefilled KV blocks into: set --kv-offload-gib > 0")


def add_kv_routes(app: FastAPI, state: ServerState, role: str) -> None:
    """The endpoints of ``role`` (see the module docstring)."""
    if role == "prefill":
        shares = ShareRegistry(SHARE_TTL_S)
        app.state.kv_shares = shares

        @app.post("/kv/prefill/v1/completions", response_class=Response)
        async def prefill_completions(req: CompletionRequest, raw: Request) -> Response:
            return await _prefill(state, completion_prompt_ids(state, req), raw, shares)

        @app.post("/kv/prefill/v1/chat/completions", response_class=Response)
        async def prefill_chat(req: ChatCompletionRequest, raw: Request) -> Response:
            return await _prefill(state, [chat_prompt_ids(state, req)], raw, shares)

        @app.post("/kv/release")
        async def kv_release(raw: Request) -> JSONResponse:
            try:
                body = await raw.json()
                sid, opened = body["id"], body["opened"]
                if not isinstance(sid, str) or not isinstance(opened, bool):
                    raise TypeError
            except Exception as exc:
                raise APIError(400, 'a KV release is JSON {"id": str, "opened": bool}') from exc
            return JSONResponse({"released": shares.release(sid, opened)})
    elif role == "decode":
        @app.post("/kv/import")
        async def kv_import(raw: Request) -> JSONResponse:
            try:
                export = kv_transfer.decode(await raw.body())
            except ValueError as exc:
                raise APIError(400, str(exc)) from exc
            try:
                result = await state.engine.call(lambda e: kv_transfer.import_blocks(e, export))
            except ShareError as exc:
                raise APIError(400, str(exc)) from exc
            except ValueError as exc:
                raise APIError(409, str(exc)) from exc
            except EngineDeadError as exc:
                raise APIError(503, str(exc)) from exc
            return JSONResponse({"imported_blocks": result.imported, "skipped_blocks": result.skipped,
                                 "opened": result.opened, "bytes": result.nbytes})
    else:
        raise ValueError(f"--role {role!r}: choose one of {', '.join(ROLES)}")


async def _prefill(state: ServerState, prompts: list[list[int]], raw: Request, shares: ShareRegistry) -> Response:
    transfer = raw.headers.get(TRANSFER_HEADER, "inline")
    if transfer not in TRANSFERS:
        raise APIError(400, f"{TRANSFER_HEADER}: {transfer!r}; choose one of {', '.join(TRANSFERS)}")
    sub = await submit(state.engine, f"prefill-{uuid.uuid4().hex}", prompts, _PREFILL_PARAMS, ())
    try:
        finals = await unless_disconnected(raw, sub.final_outputs())
    finally:
        sub.abort_unfinished()
    if finals is None:      # the router went away; nobody reads this
        return Response(status_code=499)
    for out in finals:
        error = output_error(out)
        if error is not None:
            raise APIError(500, f"prefill failed: {error}")
    share = shares if transfer == "shared" else None
    try:
        export = await state.engine.call(lambda e: kv_transfer.export_prompts(e, prompts, share))
    except EngineDeadError as exc:
        raise APIError(503, str(exc)) from exc
    headers = {SHARE_HEADER: export.share["id"]} if export.share is not None else None
    return Response(kv_transfer.encode(export), media_type=kv_transfer.CONTENT_TYPE, headers=headers)
