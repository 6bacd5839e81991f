"""The FastAPI app: OpenAI routes, health, Prometheus metrics and the engine stats the dashboard
reads. Every error is answered in OpenAI's error JSON."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from llmctl import __version__
from llmctl.engine.async_engine import AsyncEngine, EngineDeadError
from llmctl.errors import InvalidRequestError
from llmctl.server.metrics import ServerMetrics
from llmctl.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
)
from llmctl.server.serving import ChatTemplatePolicy, OpenAIServing, ServerState, sse
from llmctl.server.tokenization import (
    TOKENIZER_PATHS,
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
    tokenizer_info,
)

DEFAULT_MAX_QUEUE = 1024
MAX_BODY_BYTES = 8 << 20  # larger bodies get a 413 (a full-context prompt as token ids is far smaller)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone mid-request; no one is left to read it
STATS_MIN_INTERVAL_S = 0.05
DRAIN_POLL_S = 0.25  # how soon a stats stream notices that the server drains
Body = TypeVar("Body", bound=BaseModel)


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status_code, headers=exc.headers)


class APIKeyMiddleware:
    """``/v1/*`` and the tokenizer routes need ``Authorization: Bearer <key>``; ``/health`` and
    ``/metrics`` stay open so probes and scrapers need no secret. Plain ASGI (not
    ``BaseHTTPMiddleware``) so that streamed responses and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = path.startswith("/v1") or path in TOKENIZER_PATHS
        if scope["type"] == "http" and guarded and scope["method"] != "OPTIONS":
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                error = APIError(
                    401,
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _describe_validation_errors(errors: Iterable[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's errors as one line, and the first offending parameter."""
    parts, param = [], None
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        if error.get("type") == "json_invalid":
            return f"malformed JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}", None
        if error.get("type") == "model_type" and not loc:
            return "the request body must be a JSON object", None
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {error.get('msg')}" if where else str(error.get("msg")))
    return "; ".join(parts) or "invalid request", param


async def read_body(request: Request) -> bytes:
    """The body, refused with a 413 as soon as it is known to exceed ``MAX_BODY_BYTES``. A client
    that hangs up before its body is complete gets nothing and costs nothing: an ``APIError`` ends
    the request quietly, where a bare ``ClientDisconnect`` would be logged as a server bug."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise body_too_large()
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise body_too_large()
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(
            CLIENT_CLOSED_REQUEST,
            "the client closed the connection before sending its whole body",
            code="client_disconnected",
        ) from None
    return b"".join(chunks)


def body_too_large() -> APIError:
    return APIError(
        413, f"the request body is larger than the server's limit of {MAX_BODY_BYTES} bytes", code="request_too_large"
    )


async def parse_body(request: Request, model: type[Body]) -> Body:
    """The JSON body as ``model``, validated strictly; any content type is read as JSON (curl's
    default included). The JSON parser (pydantic's) refuses lone surrogate escapes and bodies
    nested deeper than 200 levels, which ``json.loads`` would accept or overflow the stack on."""
    raw = await read_body(request)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        message, param = _describe_validation_errors(exc.errors())
        raise bad_request(message, param) from None


def _request_schema(model: type[BaseModel]) -> dict[str, Any]:
    """OpenAPI body description for routes that parse their body themselves (its nested models
    are moved to ``components`` by ``_hoist_definitions``)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": model.model_json_schema(ref_template="#/components/schemas/{model}")}
            },
        }
    }


def _hoist_definitions(app: FastAPI) -> None:
    """Make ``/openapi.json`` self-contained: the ``$defs`` of the request bodies above become
    ``components/schemas``, where their references point (so that a client generator or a fuzzer
    such as schemathesis sees the whole body)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    for media in operation.get("requestBody", {}).get("content", {}).values():
                        components.update(media.get("schema", {}).pop("$defs", {}))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(
    async_engine: AsyncEngine,
    *,
    served_model_name: str,
    model_aliases: Iterable[str] = (),
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    state: ServerState | None = None,
    chat_templates: ChatTemplatePolicy | None = None,
) -> FastAPI:
    """An app over a started ``AsyncEngine``; the caller owns the engine's lifetime. ``state``
    (shared with the process that runs the server) carries the drain flag."""
    state = state or ServerState()
    serving = OpenAIServing(
        async_engine,
        served_model_name=served_model_name,
        model_aliases=set(model_aliases),
        state=state,
        chat_templates=chat_templates,
    )
    metrics = ServerMetrics(async_engine, served_model_name)
    engine = async_engine.engine
    app = FastAPI(title="llmctl", version=__version__, description=f"OpenAI-compatible server for {engine.model_label}")
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.server_state = state
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(bad_request(str(exc)))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(APIError(500, str(exc), type="server_error", code="engine_dead"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: still OpenAI's error JSON
        return error_response(APIError(500, f"internal error: {exc!r}", type="server_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_errors(exc.errors())
        return error_response(bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        return error_response(APIError(exc.status_code, message, type=kind, headers=dict(exc.headers or {})))

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.error is not None:
            return JSONResponse({"status": "engine_dead", "error": repr(async_engine.error)}, status_code=503)
        return JSONResponse({"status": "draining" if state.draining else "ok"})

    @app.get("/metrics")
    def prometheus_metrics() -> Response:  # sync: runs in the thread pool, where taking the engine lock is fine
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(
            id=served_model_name,
            created=int(state.started),
            root=str(engine.config.model),
            max_model_len=engine.max_model_len,
        )
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions", openapi_extra=_request_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await serving.create_completion(await parse_body(request, CompletionRequest), request)

    @app.post("/v1/chat/completions", openapi_extra=_request_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await serving.create_chat_completion(await parse_body(request, ChatCompletionRequest), request)

    @app.post("/tokenize", openapi_extra=_request_schema(TokenizeRequest))
    async def tokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(tokenize(serving, await parse_body(request, TokenizeRequest)))

    @app.post("/detokenize", openapi_extra=_request_schema(DetokenizeRequest))
    async def detokenize_route(request: Request) -> JSONResponse:
        return JSONResponse(detokenize(serving, await parse_body(request, DetokenizeRequest)))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> JSONResponse:
        return JSONResponse(tokenizer_info(serving))

    async def snapshot(max_steps: int) -> dict[str, Any]:
        # the engine lock can be held for a whole step: wait for it off the event loop
        data = await asyncio.to_thread(async_engine.stats_snapshot, max_steps)
        data["server"] = {
            "served_model_name": served_model_name,
            "max_queue": max_queue,
            "in_flight": state.in_flight,
            "rejected_queue_full": state.rejected_queue_full,
            "draining": state.draining,
        }
        return data

    @app.get("/v1/engine/stats")
    async def engine_stats(max_steps: int = Query(120, ge=0, le=512)) -> JSONResponse:
        """One snapshot of the engine (schema: ``llmctl/engine/stats.py``) plus a ``server`` section."""
        return JSONResponse(await snapshot(max_steps))

    @app.get("/v1/engine/stats/stream")
    async def engine_stats_stream(
        interval: float = Query(0.25, ge=STATS_MIN_INTERVAL_S, le=60.0), max_steps: int = Query(120, ge=0, le=512)
    ) -> StreamingResponse:
        """The snapshot as server-sent events every ``interval`` seconds, until the client leaves or
        the server drains."""

        async def events() -> AsyncIterator[str]:
            next_at = time.monotonic()
            while not state.draining:
                yield sse(json.dumps(await snapshot(max_steps)))
                next_at += interval
                while not state.draining and (left := next_at - time.monotonic()) > 0:
                    await asyncio.sleep(min(left, DRAIN_POLL_S))

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    _hoist_definitions(app)
    return app
