"""Forward one request to a replica, and to another one while nothing has reached the client.

A request is retried on another replica when the chosen one refuses the connection, times out
connecting, answers 500/502/503/504 (engine dead, draining, queue full), or breaks before the
first byte of its answer. The client has then seen nothing, so sending it again loses nothing
and duplicates nothing. A streamed answer is held back until its first chunk has arrived for the
same reason; after that the replica's bytes pass through unchanged, as they come. A non-streamed
answer is read whole before it is sent, so it can be retried until its last byte. A stream that
breaks midway ends with an OpenAI error event and ``data: [DONE]``, as llmctl's server ends a
stream whose engine failed: the tokens already sent cannot be taken back.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from llmctl.router.metrics import RouterMetrics
from llmctl.router.replicas import Replica, ReplicaSet

log = logging.getLogger("llmctl.router")

RETRY_STATUSES = frozenset({500, 502, 503, 504})
# hop-by-hop or recomputed headers, never copied between the two connections
_DROP_HEADERS = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "trailer",
        "date",
        "server",
    }
)  # the router's own server sets date and server


def openai_error(status: int, message: str, code: str, *, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def _stream_error_event(message: str) -> bytes:
    error = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def _copy_headers(headers: httpx.Headers | dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROP_HEADERS}


@dataclass
class Upstream:
    """One attempt's request to send: method, path, body, headers."""

    method: str
    path: str
    body: bytes
    headers: dict[str, str]
    query: str = ""


# the replica for the next attempt and why (a metric label), given the URLs already tried
Chooser = Callable[[set[str]], tuple[Replica, str] | None]


class Forwarder:
    def __init__(
        self, client: httpx.AsyncClient, replicas: ReplicaSet, metrics: RouterMetrics, *, max_attempts: int = 3
    ) -> None:
        self.client = client
        self.replicas = replicas
        self.metrics = metrics
        self.max_attempts = max_attempts

    async def forward(self, upstream: Upstream, choose: Chooser, *, stream: bool) -> Response:
        """Send to ``choose(tried)``'s replica, and again elsewhere while nothing has been sent."""
        arrived = time.perf_counter()
        tried: set[str] = set()
        last: Response | None = None
        retry_cause: str | None = None
        for attempt in range(self.max_attempts):
            chosen = choose(tried)
            if chosen is None:
                break
            replica, reason = chosen
            tried.add(replica.url)
            self.metrics.decisions.labels(reason).inc()
            if retry_cause is not None:
                self.metrics.retries.labels(retry_cause).inc()
                log.info("retrying on %s (attempt %d) after %s", replica.url, attempt + 1, retry_cause)
            answer, retry_cause = await self._attempt(replica, upstream, stream=stream, arrived=arrived)
            if retry_cause is None:
                return answer
            last = answer if answer is not None else last
        if last is not None:  # every replica tried answered an error: pass the last one on
            return last
        self.metrics.failures.labels("no_replica").inc()
        return openai_error(503, "no healthy replica to send the request to", "no_healthy_replica", retry_after=1)

    async def _attempt(
        self, replica: Replica, upstream: Upstream, *, stream: bool, arrived: float
    ) -> tuple[Response | None, str | None]:
        """(answer, None) when done; (last answer or None, cause) when another replica should try."""
        url = f"{replica.url}{upstream.path}" + (f"?{upstream.query}" if upstream.query else "")
        request = self.client.build_request(upstream.method, url, content=upstream.body, headers=upstream.headers)
        replica.in_flight += 1
        handed_over = False
        response: httpx.Response | None = None
        try:
            response = await self.client.send(request, stream=True)
            if response.status_code in RETRY_STATUSES:
                body = await response.aread()
                self.replicas.mark_failed(replica, f"answered {response.status_code}")
                self.metrics.requests.labels(replica.url, str(response.status_code)).inc()
                return Response(body, response.status_code, _copy_headers(response.headers)), "status"
            if stream and response.headers.get("content-type", "").startswith("text/event-stream"):
                chunks = response.aiter_raw()
                first = await anext(chunks, b"")
                self.metrics.time_to_first_byte.observe(time.perf_counter() - arrived)
                handed_over = True
                return StreamingResponse(
                    self._relay(replica, response, first, chunks), response.status_code, _copy_headers(response.headers)
                ), None
            body = await response.aread()
            self.metrics.time_to_first_byte.observe(time.perf_counter() - arrived)
            self.metrics.requests.labels(replica.url, str(response.status_code)).inc()
            return Response(body, response.status_code, _copy_headers(response.headers)), None
        except httpx.TransportError as exc:  # refused, reset, timed out: nothing reached the client
            self.replicas.mark_failed(replica, f"{type(exc).__name__}: {exc}")
            return None, "transport"
        finally:
            if not handed_over:
                replica.in_flight -= 1
                if response is not None:
                    await response.aclose()

    async def _relay(
        self, replica: Replica, response: httpx.Response, first: bytes, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """The replica's stream, byte for byte; closing it (the client left) aborts upstream."""
        code = str(response.status_code)
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as exc:
            self.replicas.mark_failed(replica, f"stream broke: {type(exc).__name__}")
            self.metrics.failures.labels("stream_broken").inc()
            code = "stream_broken"
            yield _stream_error_event(f"the replica serving this stream failed: {type(exc).__name__}")
        finally:
            replica.in_flight -= 1
            self.metrics.requests.labels(replica.url, code).inc()
            await response.aclose()


def forwarded_headers(headers: dict[str, str], client_host: str | None) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones, plus ``X-Forwarded-For``."""
    out = _copy_headers(headers)
    if client_host:
        previous = out.pop("x-forwarded-for", None)
        out["x-forwarded-for"] = f"{previous}, {client_host}" if previous else client_host
    return out
