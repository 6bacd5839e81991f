"""The router's HTTP front: OpenAI routes forwarded to a replica chosen by the policy among those
that serve the request's ``model`` (404 when none does), ``/v1/models`` as the union of theirs, its
own ``/health`` and ``/metrics``, and ``/router/replicas`` to see the rotation."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from llmctl import __version__
from llmctl.router.metrics import RouterMetrics
from llmctl.router.policy import Policy
from llmctl.router.prefix import DEFAULT_CHUNK_BYTES, DEFAULT_RING_CHUNKS, prefix_key, routing_bytes
from llmctl.router.proxy import Forwarder, Upstream, forwarded_headers
from llmctl.router.replicas import Replica, ReplicaSet

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RouterSettings:
    api_key: str | None = None
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ring_chunks: int = DEFAULT_RING_CHUNKS
    max_attempts: int = 3
    connect_timeout: float = 5.0
    read_timeout: float = 600.0


def _unauthorized() -> JSONResponse:
    body = {
        "error": {
            "message": "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


def _model_not_found(model: str, replicas: ReplicaSet) -> JSONResponse:
    served = sorted({entry["id"] for entry in replicas.models()})
    body = {
        "error": {
            "message": f"model '{model}' not found: no replica serves it (served: {', '.join(served) or 'none'})",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    return JSONResponse(body, status_code=404)


def build_router_app(
    urls: list[str],
    policy: Policy,
    settings: RouterSettings,
    *,
    discover: str | None = None,
    health_interval: float = 2.0,
    max_backoff: float = 30.0,
    discovery_interval: float = 10.0,
    client: httpx.AsyncClient | None = None,
) -> FastAPI:
    """The app; its replica health/discovery task runs for the app's lifespan. ``client`` (the
    connection pool to the replicas) is made here unless given."""
    timeout = httpx.Timeout(settings.read_timeout, connect=settings.connect_timeout)
    client = client or httpx.AsyncClient(
        timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
    )
    replicas = ReplicaSet(
        client,
        urls,
        discover=discover,
        interval=health_interval,
        max_backoff=max_backoff,
        discovery_interval=discovery_interval,
        api_key=settings.api_key,
    )
    metrics = RouterMetrics(replicas)
    forwarder = Forwarder(client, replicas, metrics, max_attempts=settings.max_attempts)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(replicas.run())
        try:
            yield
        finally:
            watcher.cancel()
            await client.aclose()

    app = FastAPI(title="llmctl router", version=__version__, lifespan=lifespan)
    app.state.replicas = replicas
    app.state.metrics = metrics

    def authorized(request: Request) -> bool:
        if settings.api_key is None:
            return True
        given = request.headers.get("authorization", "").encode()
        return secrets.compare_digest(given, f"Bearer {settings.api_key}".encode())

    def upstream_of(request: Request, body: bytes) -> Upstream:
        headers = forwarded_headers(dict(request.headers), request.client.host if request.client else None)
        return Upstream(request.method, request.url.path, body, headers, request.url.query)

    async def routed(request: Request) -> Response:
        if not authorized(request):
            return _unauthorized()
        body = await request.body()
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # a replica answers the 400
        key = prefix_key(
            routing_bytes(request.url.path, parsed), chunk_bytes=settings.chunk_bytes, ring_chunks=settings.ring_chunks
        )

        model = parsed.get("model") if isinstance(parsed, dict) else None
        model = model if isinstance(model, str) else None
        if model is not None and replicas.healthy() and not replicas.serving(model):
            return _model_not_found(model, replicas)

        def choose(tried: set[str]) -> tuple[Replica, str] | None:
            candidates = [r for r in replicas.serving(model) if r.url not in tried]
            if not candidates:
                return None
            choice = policy.choose(key, candidates, list(replicas.replicas), replicas.generation)
            return choice.replica, choice.reason

        stream = isinstance(parsed, dict) and parsed.get("stream") is True
        return await forwarder.forward(upstream_of(request, body), choose, stream=stream)

    for path in ROUTED_PATHS:
        app.add_api_route(path, routed, methods=["POST"], include_in_schema=False)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not authorized(request):
            return _unauthorized()

        if replicas.healthy() and all(r.models is not None for r in replicas.healthy()):
            return JSONResponse({"object": "list", "data": replicas.models()})

        def any_replica(tried: set[str]) -> tuple[Replica, str] | None:
            candidates = [r for r in replicas.healthy() if r.url not in tried]
            return (min(candidates, key=lambda r: r.in_flight), "least_loaded") if candidates else None

        return await forwarder.forward(upstream_of(request, b""), any_replica, stream=False)

    @app.get("/health")
    async def health() -> JSONResponse:
        up = len(replicas.healthy())
        body = {
            "status": "ok" if up else "no_healthy_replica",
            "healthy_replicas": up,
            "replicas": len(replicas.replicas),
            "policy": policy.name,
        }
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/router/replicas")
    async def replica_table(request: Request) -> JSONResponse:
        if not authorized(request):
            return _unauthorized()
        return JSONResponse(
            {
                "policy": policy.name,
                "replicas": [
                    {
                        "url": r.url,
                        "healthy": r.healthy,
                        "in_flight": r.in_flight,
                        "consecutive_failures": r.consecutive_failures,
                        "last_error": r.last_error,
                        "models": None if r.models is None else sorted(r.models),
                    }
                    for r in replicas.all()
                ],
            }
        )

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
