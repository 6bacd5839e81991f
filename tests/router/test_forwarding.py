"""The router app forwarding to stand-in replicas (httpx transports): retries before the first
byte, pass-through of client errors, a stream cut midway, and no replica at all."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from llmctl.router.app import RouterSettings, build_router_app
from llmctl.router.policy import RoundRobinPolicy

A, B = "http://10.2.0.1:8000", "http://10.2.0.2:8000"
BODY = {"prompt": "Once upon a time", "max_tokens": 4}


class BrokenStream(httpx.AsyncByteStream):
    """Two SSE events, then the connection drops."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"text": "Once"}]}\n\n'
        yield b'data: {"choices": [{"text": " upon"}]}\n\n'
        raise httpx.ReadError("connection reset by peer")


def _router(handler) -> tuple[httpx.AsyncClient, object]:
    upstream = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    app = build_router_app([A, B], RoundRobinPolicy(), RouterSettings(), client=upstream)
    for replica in app.state.replicas.all():  # in rotation without waiting for a health check
        replica.healthy = True
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router"), app


def _counter(app, name: str, **labels: str) -> float:
    return app.state.metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_5xx_before_any_byte_is_retried_on_another_replica_and_4xx_pass_through():
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}:{request.url.port}"
        seen.append(base)
        assert request.headers["authorization"] == "Bearer k" and "x-forwarded-for" in request.headers
        if base == A:
            return httpx.Response(503, json={"error": {"code": "shutting_down"}})
        if json.loads(request.content).get("max_tokens") == -1:
            return httpx.Response(400, json={"error": {"param": "max_tokens"}})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    async def scenario() -> None:
        client, app = _router(handler)
        async with client:
            answer = await client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k"})
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == "ok"
            assert seen == [A, B]  # round-robin starts at A, which is draining
            assert not app.state.replicas.replicas[A].healthy
            assert _counter(app, "llmctl:router_retries_total", reason="status") == 1
            bad = await client.post(
                "/v1/completions", json={**BODY, "max_tokens": -1}, headers={"Authorization": "Bearer k"}
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
            assert seen[-1] == B and _counter(app, "llmctl:router_retries_total", reason="status") == 1

    asyncio.run(scenario())


def test_a_stream_cut_midway_ends_with_an_error_event_and_done():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=BrokenStream())

    async def scenario() -> None:
        client, app = _router(handler)
        async with client:
            answer = await client.post("/v1/completions", json={**BODY, "stream": True})
            events = [e for e in answer.text.split("\n\n") if e]
            assert events[:2] == ['data: {"choices": [{"text": "Once"}]}', 'data: {"choices": [{"text": " upon"}]}']
            assert json.loads(events[2][6:])["error"]["code"] == "replica_failed" and events[3] == "data: [DONE]"
            assert _counter(app, "llmctl:router_failures_total", reason="stream_broken") == 1
            assert sum(r.in_flight for r in app.state.replicas.all()) == 0

    asyncio.run(scenario())


def test_no_replica_in_rotation_is_a_503_and_an_unready_router():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def scenario() -> None:
        client, app = _router(handler)
        async with client:
            answer = await client.post("/v1/completions", json=BODY)  # both refuse: both leave
            assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_healthy_replica"
            assert _counter(app, "llmctl:router_retries_total", reason="transport") == 1
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["healthy_replicas"] == 0
            again = await client.post("/v1/completions", json=BODY)
            assert again.status_code == 503 and answer.headers["retry-after"] == "1"

    asyncio.run(scenario())
