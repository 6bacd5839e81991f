"""Replica health checks with backoff, and discovery through DNS, against stand-in upstreams."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from llmctl.router.replicas import ReplicaSet, parse_discovery


class Upstreams:
    """An httpx transport answering /health per URL as the test says; it records every probe."""

    def __init__(self) -> None:
        self.answers: dict[str, object] = {}
        self.probes: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        self.probes.append(base)
        answer = self.answers.get(base, "refuse")
        if answer == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        status, body = answer
        return httpx.Response(status, content=body)


def _run(coro):
    return asyncio.run(coro)


def test_failed_replica_leaves_rotation_and_backs_off_then_returns():
    upstreams = Upstreams()
    a, b = "http://10.1.0.1:8000", "http://10.1.0.2:8000"
    upstreams.answers = {a: (200, b'{"status": "ok"}'), b: "refuse"}

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(upstreams)) as client:
            replicas = ReplicaSet(client, [a, b], interval=1.0, max_backoff=4.0)
            ra, rb = replicas.replicas[a], replicas.replicas[b]
            assert not ra.healthy and not rb.healthy  # nobody is in rotation before its first check
            for replica in (ra, rb):
                await replicas.check(replica)
            assert replicas.healthy() == [ra]
            delays = []
            for _ in range(4):
                before = time.monotonic()
                await replicas.check(rb)
                delays.append(round(rb.next_check - before))
            assert delays == [2, 4, 4, 4]  # 1 s doubling after the first failure, capped at 4 s
            assert "ConnectError" in rb.last_error
            upstreams.answers[b] = (200, b"")  # vLLM's /health: an empty 200
            await replicas.check(rb)
            assert rb.healthy and rb.consecutive_failures == 0
            upstreams.answers[a] = (200, b'{"status": "draining"}')  # llmctl after SIGTERM
            await replicas.check(ra)
            assert not ra.healthy and "draining" in ra.last_error
            upstreams.answers[a] = (503, b'{"status": "engine_dead"}')
            await replicas.check(ra)
            assert replicas.healthy() == [rb]

    _run(scenario())


def test_run_loop_checks_due_replicas_and_passive_failures_follow_backoff():
    upstreams = Upstreams()
    a = "http://10.1.0.1:8000"
    upstreams.answers = {a: (200, b'{"status": "ok"}')}

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(upstreams)) as client:
            replicas = ReplicaSet(client, [a], interval=0.1, max_backoff=0.4)
            task = asyncio.create_task(replicas.run())
            try:
                for _ in range(100):
                    await asyncio.sleep(0.02)
                    if replicas.healthy():
                        break
                assert replicas.healthy()
                replicas.mark_failed(replicas.replicas[a], "connection refused by a request")
                assert not replicas.healthy()
                await asyncio.sleep(0.6)  # the next check (0.1 s later) finds it well again
                assert replicas.healthy()
            finally:
                task.cancel()

    _run(scenario())


def test_discovery_resolves_a_name_into_one_replica_per_address():
    async def scenario() -> ReplicaSet:
        async with httpx.AsyncClient() as client:
            replicas = ReplicaSet(client, [], discover="localhost:18555")
            await replicas.resolve()
            return replicas

    replicas = _run(scenario())
    assert "http://127.0.0.1:18555" in replicas.replicas
    assert set(replicas.replicas) <= {"http://127.0.0.1:18555", "http://[::1]:18555"}
    generation = replicas.generation
    replicas.sync({"http://127.0.0.1:18555"})
    replicas.sync({"http://127.0.0.1:18555"})
    assert replicas.generation <= generation + 1  # unchanged membership: no ring rebuild


def test_discovery_keeps_the_replicas_when_dns_fails(monkeypatch):
    def nxdomain(*args: object, **kwargs: object) -> None:  # no DNS query leaves this machine
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", nxdomain)

    async def scenario() -> ReplicaSet:
        async with httpx.AsyncClient() as client:
            replicas = ReplicaSet(client, ["http://127.0.0.1:1"], discover="llmctl-headless:8000")
            await replicas.resolve()
            return replicas

    assert list(_run(scenario()).replicas) == ["http://127.0.0.1:1"]


@pytest.mark.parametrize("bad", ["llmctl-headless", "llmctl-headless:http", ":8000"])
def test_discovery_target_must_be_name_and_port(bad):
    with pytest.raises(ValueError, match="NAME:PORT"):
        parse_discovery(bad)


def test_a_garbled_health_answer_takes_the_replica_out_without_stopping_the_checks():
    upstreams = Upstreams()
    a = "http://10.1.0.1:8000"
    upstreams.answers = {a: (200, b'{"status": "ok"')}  # cut short: not JSON

    async def scenario() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(upstreams)) as client:
            replicas = ReplicaSet(client, [a], interval=1.0)
            await replicas.check(replicas.replicas[a])
            assert not replicas.healthy() and "JSONDecodeError" in replicas.replicas[a].last_error
            upstreams.answers[a] = (200, b'{"status": "ok"}')
            await replicas.check(replicas.replicas[a])
            assert replicas.healthy()

    _run(scenario())
