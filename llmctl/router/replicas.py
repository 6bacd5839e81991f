"""The replicas behind the router: where they are (flags or a headless Service's DNS), whether
they are up (``/health`` polled with exponential backoff), and how busy this router keeps them.

A replica starts out of rotation and joins after its first good ``/health``; each good check also
reads its ``/v1/models``, so a request naming a ``model`` goes only to the replicas that serve it. One that fails a
check, refuses a connection, breaks a stream or says it is draining leaves the rotation at once
and is checked again after ``interval``, then 2x, 4x... up to ``max_backoff`` seconds, so a dead
replica costs one probe now and then rather than one failed request per routing decision.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass

import httpx

log = logging.getLogger("llmctl.router")


@dataclass(eq=False)
class Replica:
    url: str
    healthy: bool = False
    in_flight: int = 0  # requests this router is proxying to it now
    consecutive_failures: int = 0
    next_check: float = 0.0  # time.monotonic() of the next health check
    last_error: str = ""
    models: dict[str, dict] | None = None  # its /v1/models entries by id; None until read

    def serves(self, model: str) -> bool:
        return self.models is not None and model in self.models


def parse_discovery(target: str) -> tuple[str, int]:
    """``NAME:PORT`` (a Kubernetes headless Service, e.g. ``llmctl-headless.ns.svc:8000``)."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--discover wants NAME:PORT, got {target!r}")
    return host, int(port)


def _url(address: str, port: int) -> str:
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


class ReplicaSet:
    """The replicas and the background task that keeps their health and membership current."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        urls: list[str],
        *,
        discover: str | None = None,
        interval: float = 2.0,
        max_backoff: float = 30.0,
        timeout: float = 2.0,
        discovery_interval: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.interval = interval
        self.max_backoff = max_backoff
        self.timeout = timeout
        self.discover = parse_discovery(discover) if discover else None
        self.discovery_interval = discovery_interval
        self.replicas: dict[str, Replica] = {}
        self.generation = 0  # bumped whenever membership changes (the hash ring is rebuilt)
        self.sync({url.rstrip("/") for url in urls})

    def all(self) -> list[Replica]:
        return list(self.replicas.values())

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def sync(self, urls: set[str]) -> None:
        """Make the membership exactly ``urls`` (discovery, or the static list at start)."""
        added = urls - self.replicas.keys()
        removed = self.replicas.keys() - urls
        for url in removed:
            del self.replicas[url]
        for url in sorted(added):
            self.replicas[url] = Replica(url)
        if added or removed:
            self.generation += 1
            log.info("replicas: +%s -%s", sorted(added), sorted(removed))

    def mark_failed(self, replica: Replica, reason: str) -> None:
        """Out of rotation now; the next check follows the backoff."""
        replica.consecutive_failures += 1
        replica.last_error = reason
        delay = min(self.max_backoff, self.interval * 2 ** (replica.consecutive_failures - 1))
        replica.next_check = time.monotonic() + delay
        if replica.healthy:
            log.warning("replica %s out of rotation: %s (next check in %.1fs)", replica.url, reason, delay)
        replica.healthy = False

    def _mark_ok(self, replica: Replica) -> None:
        if not replica.healthy:
            log.info("replica %s in rotation", replica.url)
        replica.healthy = True
        replica.consecutive_failures = 0
        replica.last_error = ""
        replica.next_check = time.monotonic() + self.interval

    async def check(self, replica: Replica) -> None:
        """``/health`` answering 200 and not ``{"status": "draining"}`` (vLLM answers an empty 200)."""
        try:
            response = await self.client.get(f"{replica.url}/health", timeout=self.timeout)
            status = "ok"
            if response.status_code == 200 and response.content.strip().startswith(b"{"):
                status = str(response.json().get("status", "ok"))  # a JSON object: checked above
            if response.status_code != 200 or status != "ok":
                self.mark_failed(replica, f"/health: {response.status_code} {status}")
            else:
                await self._read_models(replica)
                self._mark_ok(replica)
        except Exception as exc:  # noqa: BLE001 - whatever a replica answers, the watcher keeps running
            self.mark_failed(replica, f"/health: {type(exc).__name__}: {exc}")

    async def _read_models(self, replica: Replica) -> None:
        """The replica's served models, kept as they were when it does not answer them."""
        try:
            response = await self.client.get(f"{replica.url}/v1/models", headers=self.headers, timeout=self.timeout)
            data = response.json().get("data", []) if response.status_code == 200 else None
        except Exception as exc:  # noqa: BLE001 - the model list never decides health
            log.warning("replica %s: /v1/models: %s: %s", replica.url, type(exc).__name__, exc)
            return
        if not isinstance(data, list):
            log.warning("replica %s: /v1/models answered %d without a list", replica.url, response.status_code)
            return
        models = {str(entry["id"]): entry for entry in data if isinstance(entry, dict) and "id" in entry}
        if models.keys() != (replica.models or {}).keys():
            log.info("replica %s serves %s", replica.url, sorted(models))
        replica.models = models

    def serving(self, model: str | None) -> list[Replica]:
        """The healthy replicas a request for ``model`` may go to: all of them without a model;
        else those that serve it, or, when none is known to, those whose list is not read yet."""
        healthy = self.healthy()
        if model is None:
            return healthy
        known = [r for r in healthy if r.serves(model)]
        return known or [r for r in healthy if r.models is None]

    def models(self) -> list[dict]:
        """Every model a healthy replica serves, once each (the first replica's entry)."""
        seen: dict[str, dict] = {}
        for replica in self.healthy():
            for model_id, entry in (replica.models or {}).items():
                seen.setdefault(model_id, entry)
        return list(seen.values())

    async def resolve(self) -> None:
        """A headless Service's A/AAAA records are its ready pods: one replica per address."""
        assert self.discover is not None
        host, port = self.discover
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:  # no ready pod yet (NXDOMAIN) or DNS trouble: keep what we have
            log.warning("discovery of %s failed: %s", host, exc)
            return
        self.sync({_url(str(info[4][0]), port) for info in infos})

    async def run(self) -> None:
        """Forever: re-resolve the Service now and then; check every replica whose time has come."""
        next_discovery = 0.0
        tick = min(0.25, self.interval)
        while True:
            now = time.monotonic()
            if self.discover is not None and now >= next_discovery:
                await self.resolve()
                next_discovery = now + self.discovery_interval
            due = [r for r in self.replicas.values() if r.next_check <= now]
            if due:
                await asyncio.gather(*(self.check(r) for r in due))
            await asyncio.sleep(tick)
