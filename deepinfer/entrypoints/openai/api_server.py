"""The OpenAI-compatible HTTP server: FastAPI app factory and ``run_server``.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /health, POST /tokenize, POST /detokenize (vLLM shapes), GET /metrics
(Prometheus, vLLM names); with ``--role prefill|decode`` the internal KV routes of
prefill/decode disaggregation (kv_routes.py). Every error is OpenAI's ``{"error": {...}}`` body;
request validation errors are 400 (not FastAPI's 422). With an API key, every
route but /health wants ``Authorization: Bearer <key>``.

One :class:`Engine` serves all connections; :class:`AsyncEngine` steps it on
its own thread so the event loop never blocks on the model.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from deepinfer.engine.engine import Engine, freeze_heap
from deepinfer.entrypoints.llm import DEFAULT_MODEL
from deepinfer.entrypoints.openai.async_engine import AsyncEngine, EngineDeadError
from deepinfer.entrypoints.openai.chat import create_chat_completion
from deepinfer.entrypoints.openai.completions import create_completion
from deepinfer.entrypoints.openai.kv_routes import add_kv_routes, check_role
from deepinfer.entrypoints.openai.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from deepinfer.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse,
                                                   CompletionRequest, CompletionResponse, DetokenizeRequest,
                                                   DetokenizeResponse, ErrorResponse, ModelCard, ModelList,
                                                   TokenizeChatRequest, TokenizeCompletionRequest,
                                                   TokenizeResponse)
from deepinfer.entrypoints.openai.reasoning import get_reasoning_parser
from deepinfer.entrypoints.openai.serving import APIError, ServerState, error_body, ignored_fields, render_chat
from deepinfer.entrypoints.openai.tool_parsers import (TOOL_CALL_FORMATS, default_tool_call_parser,
                                                       get_tool_call_format)

logger = logging.getLogger(__name__)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 500, 503)}


class _APIKeyMiddleware:
    """401 for any request but /health without ``Authorization: Bearer <key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                resp = JSONResponse(error_body(401, "Incorrect or missing API key; send "
                                                    "'Authorization: Bearer <key>'", code="invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def default_model_name(engine: Engine) -> str:
    """The checkpoint path as configured, as vLLM names it; "tiny-model" for the embedded one."""
    path = engine.config.model.path
    return "tiny-model" if path == DEFAULT_MODEL else path


def build_app(engine: Engine, *, served_model_names: Sequence[str] | None = None,
              api_key: str | None = None, health_timeout_s: float = 30.0,
              tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
              reasoning_parser: str | None = None, role: str | None = None) -> FastAPI:
    """The server app for ``engine``. The engine thread starts and stops with the
    app's lifespan; ``app.state.async_engine`` reaches it (tests read engine state
    through ``async_engine.call``). ``tool_call_parser``, ``enable_auto_tool_choice``
    and ``reasoning_parser`` are ``deepinfer serve``'s flags of the same names (vLLM's):
    the tool-call format (None: the model's own, ``default_tool_call_parser``), whether
    the model may choose to call tools, and how a thinking model's reasoning is split off.
    ``role``: ``--role``, the instance's part in prefill/decode disaggregation (kv_routes.py)."""
    _check_tool_flags(tool_call_parser, enable_auto_tool_choice)
    check_role(role, engine.config.cache.kv_offload_bytes)
    names = list(served_model_names or [default_model_name(engine)])
    metrics = ServerMetrics(names[0])
    async_engine = AsyncEngine(engine, metrics)
    state = ServerState(engine=async_engine, tokenizer=engine.tokenizer, model_names=names,
                        max_model_len=engine.config.model.max_model_len,
                        vocab_size=engine.config.model.vocab_size,
                        tool_format=get_tool_call_format(
                            tool_call_parser or default_tool_call_parser(engine.config.model.hf_config)),
                        auto_tool_choice=enable_auto_tool_choice,
                        reasoning=get_reasoning_parser(reasoning_parser) if reasoning_parser else None)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="deepinfer", summary="OpenAI-compatible server", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.server_state = state
    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    _add_error_handlers(app)

    @app.get("/health", response_class=Response,
             responses={200: {"description": "The engine is serving (empty body)"},
                        503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 while the engine thread is alive and answers between steps."""
        try:
            await async_engine.call(lambda _: None, timeout_s=health_timeout_s)
        except asyncio.TimeoutError as exc:
            raise APIError(503, f"the engine loop has not answered for {health_timeout_s:g} s") from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from exc
        return Response(status_code=200)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.config.model.path,
                                         max_model_len=state.max_model_len) for name in names])

    @app.post("/v1/completions", responses=_ok(CompletionResponse))
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        _log_ignored(req)
        return await create_completion(state, req, raw)

    @app.post("/v1/chat/completions", responses=_ok(ChatCompletionResponse))
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        _log_ignored(req)
        return await create_chat_completion(state, req, raw)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        state.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            text = render_chat(state.tokenizer, req.messages, req.add_generation_prompt is not False,
                               req.chat_template_kwargs, tool_format=state.tool_format)
            add_special = bool(req.add_special_tokens)
        else:
            text = req.prompt
            add_special = req.add_special_tokens is not False
        ids = state.tokenizer.encode(text, add_special_tokens=add_special)
        strs = [state.tokenizer.id_to_token_text(t) for t in ids] if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                                token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        state.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < state.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {state.vocab_size})", param="tokens")
        return DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens))

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text format", "content": {"text/plain": {}}}})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if role is not None:
        add_kv_routes(app, state, role)

    app.openapi = lambda: _openapi_without_422(app)
    return app


def _check_tool_flags(tool_call_parser: str | None, enable_auto_tool_choice: bool) -> None:
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes "
                         f"calls in: {', '.join(sorted(TOOL_CALL_FORMATS))})")


def _ok(model: type) -> dict:
    """OpenAPI responses of a generating route: JSON, or server-sent events when streamed."""
    return {200: {"model": model, "content": {"text/event-stream": {}}}, **_ERRORS}


def _openapi_without_422(app: FastAPI) -> dict:
    """FastAPI's schema, minus the 422 responses it documents by default: validation
    errors are answered with 400 here."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _log_ignored(req: BaseModel) -> None:
    """Unknown fields are accepted and ignored, as vLLM does; the log names them."""
    ignored = ignored_fields(req)
    if ignored:
        logger.warning("ignoring request fields this server does not know: %s", ", ".join(sorted(ignored)))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def on_api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return JSONResponse(error_body(503, str(exc)), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problems)"
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}: {exc}"),
                            status_code=500)


def run_server(args: argparse.Namespace) -> None:
    """``deepinfer serve``: build the engine from the CLI's engine flags and serve until interrupted."""
    from deepinfer.entrypoints.cli import engine_kwargs
    from deepinfer.entrypoints.llm import build_engine_config

    _check_tool_flags(args.tool_call_parser, args.enable_auto_tool_choice)   # before the slow part
    check_role(args.role, int(args.kv_offload_gib * 2**30))
    engine = Engine(build_engine_config(**engine_kwargs(args)))
    freeze_heap()   # the engine lives as long as the process
    app = build_app(engine, served_model_names=args.served_model_name, api_key=args.api_key,
                    tool_call_parser=args.tool_call_parser, enable_auto_tool_choice=args.enable_auto_tool_choice,
                    reasoning_parser=args.reasoning_parser, role=args.role)
    logger.warning("serving %s on http://%s:%d", app.state.server_state.model_name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
