"""The FastAPI app: OpenAI routes, health, Prometheus metrics and the engine stats the dashboard
reads. Every error is answered in OpenAI's error JSON."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from datetime import datetime, timezone
from typing import Any, TypeVar

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from llmctl import __version__
from llmctl.engine.async_engine import EngineDeadError
from llmctl.errors import InvalidRequestError
from llmctl.server import dialects
from llmctl.server.dialects import anthropic, ollama, responses
from llmctl.server.dialects.bridge import parse as parse_dialect
from llmctl.server.embeddings import (
    UNVERSIONED_PATHS,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from llmctl.server.model_manager import ModelManager, ServedModel, Slot, keep_alive_of
from llmctl.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
)
from llmctl.server.serving import sse
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


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    """``exc`` in the error JSON of the API that ``path`` belongs to (OpenAI's, Anthropic's, Ollama's)."""
    return JSONResponse(dialects.error_body(path, exc), status_code=exc.status_code, headers=exc.headers)


class APIKeyMiddleware:
    """``/v1/*``, the Ollama API (``/api/*``) and the tokenizer routes need ``Authorization: Bearer
    <key>`` (or Anthropic's ``x-api-key: <key>``); ``/health`` and ``/metrics`` stay open so probes
    and scrapers need no secret. Plain ASGI (not ``BaseHTTPMiddleware``) so that streamed responses
    and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        guarded = path.startswith(("/v1", "/api/")) or path in TOKENIZER_PATHS or path in UNVERSIONED_PATHS
        if scope["type"] == "http" and guarded and scope["method"] != "OPTIONS":
            headers = Headers(scope=scope)
            given = headers.get("authorization", "").encode()
            given_key = headers.get("x-api-key", "").encode()
            if not (
                secrets.compare_digest(given, self.expected) or secrets.compare_digest(given_key, self.expected_key)
            ):
                error = APIError(
                    401,
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error_response(error, path)(scope, receive, send)
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


def _model_of(raw: bytes, model: type[BaseModel]) -> str | None:
    """The ``model`` a dialect's body names, the body validated as that dialect validates it first
    (so a malformed body is that API's 400 before any model is resolved or loaded)."""
    return parse_dialect(raw, model).model  # type: ignore[attr-defined]


def build_app(
    manager: ModelManager,
    *,
    api_key: str | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    enable_lora_runtime_updates: bool = False,
) -> FastAPI:
    """An app over the models ``manager`` serves; the caller owns their lifetime (``manager.shutdown``).
    Every route resolves the request's ``model`` through ``manager.run``: the model is loaded on
    demand and held until the answer ends. ``manager.state`` carries the drain flag.
    ``enable_lora_runtime_updates``: the routes that load and unload LoRA adapters exist."""
    state = manager.state
    app = FastAPI(
        title="llmctl", version=__version__, description=f"OpenAI-compatible server for {', '.join(manager.names)}"
    )
    app.state.manager = manager
    app.state.server_state = state
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(bad_request(str(exc)), request.url.path)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(APIError(500, str(exc), type="server_error", code="engine_dead"), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:  # a bug: still an error JSON
        return error_response(APIError(500, f"internal error: {exc!r}", type="server_error"), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_errors(exc.errors())
        return error_response(bad_request(message, param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if exc.status_code == 404 else str(exc.detail)
        error = APIError(exc.status_code, message, type=kind, headers=dict(exc.headers or {}))
        return error_response(error, request.url.path)

    @app.get("/health")
    async def health() -> JSONResponse:
        if (error := manager.dead_error()) is not None:
            return JSONResponse({"status": "engine_dead", "error": repr(error)}, status_code=503)
        return JSONResponse({"status": "draining" if state.draining else "ok"})

    @app.get("/metrics")
    def prometheus_metrics() -> Response:  # sync: runs in the thread pool, where taking the engine lock is fine
        return Response(manager.exposition(), media_type=CONTENT_TYPE_LATEST)

    # ---- the models: what can be served, what is loaded (llmctl/server/model_manager.py) ----
    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = []
        for slot in manager.slots.values():
            served = slot.served
            card = ModelCard(
                id=slot.spec.name,
                created=int(state.started),
                root=str(served.async_engine.engine.config.model) if served else (slot.last_root or slot.spec.source),
                max_model_len=served.serving.max_model_len if served else slot.last_max_model_len,
            ).model_dump()
            cards.append({**card, "loaded": served is not None, "status": slot.status})
            for name, path in slot.spec.adapters.items():
                adapter = ModelCard(id=name, created=int(state.started), root=path, parent=slot.spec.name)
                cards.append({**adapter.model_dump(), "loaded": served is not None, "status": slot.status})
        return JSONResponse({**ModelList(data=[]).model_dump(), "data": cards})

    if enable_lora_runtime_updates:  # as vLLM: only behind the flag

        @app.post("/v1/load_lora_adapter", openapi_extra=_request_schema(LoadLoRAAdapterRequest))
        async def load_lora_adapter(request: Request) -> JSONResponse:
            body = await parse_body(request, LoadLoRAAdapterRequest)
            return JSONResponse(await manager.load_adapter(body.lora_name, body.lora_path, body.base_model_name))

        @app.post("/v1/unload_lora_adapter", openapi_extra=_request_schema(UnloadLoRAAdapterRequest))
        async def unload_lora_adapter(request: Request) -> JSONResponse:
            body = await parse_body(request, UnloadLoRAAdapterRequest)
            return JSONResponse(manager.unload_adapter(body.lora_name))

    @app.get("/v1/models/status")
    async def models_status() -> JSONResponse:
        return JSONResponse(manager.status())

    @app.post("/v1/models/unload", openapi_extra=_request_schema(UnloadRequest))
    async def unload_model(request: Request) -> JSONResponse:
        body = await parse_body(request, UnloadRequest)
        return JSONResponse(await manager.stop(body.model, force=body.force))

    # ---- OpenAI ----
    @app.post("/v1/completions", openapi_extra=_request_schema(CompletionRequest))
    async def completions(request: Request) -> Response:
        raw = await read_body(request)
        body = _validated(raw, CompletionRequest)
        return await manager.run(
            body.model, keep_alive_of(raw), lambda m: m.serving.create_completion(body, request), request
        )

    @app.post("/v1/chat/completions", openapi_extra=_request_schema(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        raw = await read_body(request)
        body = _validated(raw, ChatCompletionRequest)
        return await manager.run(
            body.model, keep_alive_of(raw), lambda m: m.serving.create_chat_completion(body, request), request
        )

    # embeddings, rerank and score: pooling requests on the same engine (llmctl/server/embeddings.py)
    @app.post("/v1/embeddings", openapi_extra=_request_schema(EmbeddingRequest))
    async def embeddings(request: Request) -> JSONResponse:
        raw = await read_body(request)
        body = _validated(raw, EmbeddingRequest)
        answer = await manager.run(body.model, keep_alive_of(raw), lambda m: m.pooling.embeddings(body, request))
        return JSONResponse(answer)

    @app.post("/v1/rerank", openapi_extra=_request_schema(RerankRequest))
    @app.post("/rerank", openapi_extra=_request_schema(RerankRequest))
    async def rerank(request: Request) -> JSONResponse:
        raw = await read_body(request)
        body = _validated(raw, RerankRequest)
        return JSONResponse(
            await manager.run(body.model, keep_alive_of(raw), lambda m: m.pooling.rerank(body, request))
        )

    @app.post("/v1/score", openapi_extra=_request_schema(ScoreRequest))
    @app.post("/score", openapi_extra=_request_schema(ScoreRequest))
    async def score(request: Request) -> JSONResponse:
        raw = await read_body(request)
        body = _validated(raw, ScoreRequest)
        return JSONResponse(await manager.run(body.model, keep_alive_of(raw), lambda m: m.pooling.score(body, request)))

    # the other APIs clients speak, translated onto the chat path (llmctl/server/dialects)
    @app.post("/v1/messages", openapi_extra=_request_schema(anthropic.MessagesRequest))
    async def anthropic_messages(request: Request) -> Response:
        raw = await read_body(request)
        model = _model_of(raw, anthropic.MessagesRequest)
        return await manager.run(
            model, keep_alive_of(raw), lambda m: anthropic.create_message(m.serving, raw, request), request
        )

    @app.post("/v1/messages/count_tokens", openapi_extra=_request_schema(anthropic.CountTokensRequest))
    async def anthropic_count_tokens(request: Request) -> JSONResponse:
        raw = await read_body(request)
        model = _model_of(raw, anthropic.CountTokensRequest)
        return JSONResponse(await manager.run(model, None, lambda m: anthropic.count_tokens(m.serving, raw)))

    @app.post("/v1/responses", openapi_extra=_request_schema(responses.ResponsesRequest))
    async def openai_responses(request: Request) -> Response:
        raw = await read_body(request)
        model = _model_of(raw, responses.ResponsesRequest)
        return await manager.run(
            model, keep_alive_of(raw), lambda m: responses.create_response(m.serving, raw, request), request
        )

    @app.post("/api/chat", openapi_extra=_request_schema(ollama.ChatRequest))
    async def ollama_chat(request: Request) -> Response:
        raw = await read_body(request)
        req = parse_dialect(raw, ollama.ChatRequest)
        return await manager.run(
            req.model, req.keep_alive, lambda m: ollama.chat(m.serving, raw, request), request, ollama=True
        )

    @app.post("/api/generate", openapi_extra=_request_schema(ollama.GenerateRequest))
    async def ollama_generate(request: Request) -> Response:
        raw = await read_body(request)
        req = parse_dialect(raw, ollama.GenerateRequest)
        return await manager.run(
            req.model, req.keep_alive, lambda m: ollama.generate(m.serving, raw, request), request, ollama=True
        )

    @app.get("/api/tags")
    async def ollama_tags() -> JSONResponse:
        started = _iso(state.started)
        return JSONResponse({"models": [ollama_tag(slot, started) for slot in manager.slots.values()]})

    @app.post("/api/show", openapi_extra=_request_schema(ollama.ShowRequest))
    async def ollama_show(request: Request) -> JSONResponse:
        raw = await read_body(request)
        req = parse_dialect(raw, ollama.ShowRequest)
        if req.model is None and req.name is None:
            raise bad_request("model is required", "model")
        answer = await manager.run(
            req.model or req.name, None, _async(lambda m: ollama.show(m.serving, m.info, raw)), ollama=True
        )
        return JSONResponse(answer)

    @app.get("/api/ps")
    async def ollama_ps() -> JSONResponse:
        running = []
        for slot in manager.slots.values():
            if slot.served is not None:
                expires = manager.expires_at_wall(slot)
                running.append({**slot.served.info.running(), **({"expires_at": _iso(expires)} if expires else {})})
        return JSONResponse({"models": running})

    @app.get("/api/version")
    async def ollama_version() -> JSONResponse:
        return JSONResponse({"version": ollama.API_VERSION})

    @app.post("/api/embed", openapi_extra=_request_schema(ollama.EmbedRequest))
    async def ollama_embed(request: Request) -> JSONResponse:
        req = parse_dialect(await read_body(request), ollama.EmbedRequest)
        answer = await manager.run(
            req.model, req.keep_alive, lambda m: ollama.embed(m.pooling, req, request), ollama=True
        )
        return JSONResponse(answer)

    @app.post("/api/embeddings", openapi_extra=_request_schema(ollama.LegacyEmbeddingsRequest))
    async def ollama_embeddings(request: Request) -> JSONResponse:
        req = parse_dialect(await read_body(request), ollama.LegacyEmbeddingsRequest)
        answer = await manager.run(
            req.model, req.keep_alive, lambda m: ollama.legacy_embeddings(m.pooling, req, request), ollama=True
        )
        return JSONResponse(answer)

    @app.post("/tokenize", openapi_extra=_request_schema(TokenizeRequest))
    async def tokenize_route(request: Request) -> JSONResponse:
        body = await parse_body(request, TokenizeRequest)
        return JSONResponse(await manager.run(body.model, None, _async(lambda m: tokenize(m.serving, body))))

    @app.post("/detokenize", openapi_extra=_request_schema(DetokenizeRequest))
    async def detokenize_route(request: Request) -> JSONResponse:
        body = await parse_body(request, DetokenizeRequest)
        return JSONResponse(await manager.run(body.model, None, _async(lambda m: detokenize(m.serving, body))))

    @app.get("/tokenizer_info")
    async def tokenizer_info_route(model: str | None = Query(None)) -> JSONResponse:
        return JSONResponse(await manager.run(model, None, _async(lambda m: tokenizer_info(m.serving))))

    async def snapshot(model: str | None, max_steps: int) -> dict[str, Any]:
        """The engine stats of ``model`` (default: the most recently used loaded model), never
        loading one: with none loaded, only the ``server`` section."""
        if model is not None:
            slot = manager.resolve(model)
        else:
            loaded = [s for s in manager.slots.values() if s.served is not None]
            slot = max(loaded, key=lambda s: s.last_used, default=manager.slots[manager.default_name])
        served = slot.served
        data: dict[str, Any] = {}
        if served is not None:
            # the engine lock can be held for a whole step: wait for it off the event loop
            data = await asyncio.to_thread(served.async_engine.stats_snapshot, max_steps)
        data["server"] = {
            "served_model_name": slot.spec.name,
            "max_queue": max_queue,
            "in_flight": manager.in_flight,
            "rejected_queue_full": manager.rejected_queue_full,
            "draining": state.draining,
            "loaded": served is not None,
            "models": manager.status()["models"],
        }
        return data

    @app.get("/v1/engine/stats")
    async def engine_stats(max_steps: int = Query(120, ge=0, le=512), model: str | None = Query(None)) -> JSONResponse:
        """One snapshot of the engine (schema: ``llmctl/engine/stats.py``) plus a ``server`` section."""
        return JSONResponse(await snapshot(model, max_steps))

    @app.get("/v1/engine/stats/stream")
    async def engine_stats_stream(
        interval: float = Query(0.25, ge=STATS_MIN_INTERVAL_S, le=60.0),
        max_steps: int = Query(120, ge=0, le=512),
        model: str | None = Query(None),
    ) -> StreamingResponse:
        """The snapshot as server-sent events every ``interval`` seconds, until the client leaves or
        the server drains."""
        if model is not None:
            manager.resolve(model)  # an unknown model: 404 now, not an endless stream of them

        async def events() -> AsyncIterator[str]:
            next_at = time.monotonic()
            while not state.draining:
                yield sse(json.dumps(await snapshot(model, max_steps)))
                next_at += interval
                while not state.draining and (left := next_at - time.monotonic()) > 0:
                    await asyncio.sleep(min(left, DRAIN_POLL_S))

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    _hoist_definitions(app)
    return app


class UnloadRequest(BaseModel):
    """``POST /v1/models/unload``: unload ``model`` now (``llmctl stop``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    force: bool = False  # cancel its requests in flight instead of refusing with a 409


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body; ``base_model_name`` picks the base model when
    the server serves several, default the first)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` accepted and ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str
    lora_int_id: int | None = None


def _validated(raw: bytes, model: type[Body]) -> Body:
    """``raw`` as ``model``, validated as ``parse_body`` validates it."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        message, param = _describe_validation_errors(exc.errors())
        raise bad_request(message, param) from None


def _async(function: Any) -> Any:
    """A synchronous route body as the coroutine function ``ModelManager.run`` takes."""

    async def call(served: ServedModel) -> Any:
        return function(served)

    return call


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat().replace("+00:00", "Z")


def ollama_tag(slot: Slot, modified_at: str) -> dict[str, Any]:
    """``/api/tags``' entry of a model: what its last load said, or its name alone before one."""
    if slot.served is not None:
        return slot.served.info.tag()
    if slot.last_info is not None:
        return slot.last_info
    return {
        "name": slot.spec.name,
        "model": slot.spec.name,
        "modified_at": modified_at,
        "size": 0,
        "digest": "",
        "details": {
            "parent_model": "",
            "format": "llmctl",
            "family": "",
            "families": [],
            "parameter_size": "",
            "quantization_level": "",
        },
    }
