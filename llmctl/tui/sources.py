"""Where the dashboard's snapshots come from, behind one small interface.

A source's ``fetch()`` returns the engine's ``stats_snapshot()`` dict (schema in
``llmctl/engine/stats.py``), ``None`` when there is nothing new, or raises ``SourceError`` when the
engine cannot be reached; the dashboard then shows the last data greyed and keeps retrying.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import httpx

STATS_PATH = "/v1/engine/stats"


class SourceError(RuntimeError):
    """The snapshot could not be had (server down, bad answer); the message says why, in one line."""


class StatsSource(Protocol):
    label: str  # shown in the dashboard's header: a URL, "local", a file name

    async def fetch(self) -> dict[str, Any] | None: ...

    async def close(self) -> None: ...


class HttpSource:
    """Polls ``GET {url}/v1/engine/stats`` of a running ``llmctl serve``."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 2.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url.rstrip("/")
        self.label = self.url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)

    async def fetch(self) -> dict[str, Any]:
        try:
            response = await self._client.get(STATS_PATH)
        except httpx.HTTPError as exc:
            raise SourceError(f"{type(exc).__name__}: {exc or 'no answer'}") from exc
        if response.status_code == 401:
            raise SourceError(f"HTTP 401 from {self.url}{STATS_PATH}: wrong or missing --api-key")
        if response.status_code != 200:
            raise SourceError(f"HTTP {response.status_code} from {self.url}{STATS_PATH}")
        try:
            snapshot = response.json()
        except ValueError as exc:
            raise SourceError(f"{self.url}{STATS_PATH} did not answer JSON") from exc
        if not isinstance(snapshot, dict) or "kv" not in snapshot:
            raise SourceError(f"{self.url}{STATS_PATH} did not answer an engine stats snapshot")
        return snapshot

    async def close(self) -> None:
        await self._client.aclose()


class ReplaySource:
    """Hands out recorded snapshots one per fetch; after the last one, ``None`` (or from the start
    again with ``loop``)."""

    def __init__(self, snapshots: Iterable[dict[str, Any]], label: str = "replay", loop: bool = False) -> None:
        self.snapshots = list(snapshots)
        if not self.snapshots:
            raise ValueError("a replay needs at least one snapshot")
        self.label = label
        self.loop = loop
        self.position = 0

    @classmethod
    def from_jsonl(cls, path: Path | str, loop: bool = False) -> ReplaySource:
        path = Path(path)
        snapshots = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return cls(snapshots, label=path.name, loop=loop)

    async def fetch(self) -> dict[str, Any] | None:
        if self.position >= len(self.snapshots):
            if not self.loop:
                return None
            self.position = 0
        snapshot = self.snapshots[self.position]
        self.position += 1
        return snapshot

    async def close(self) -> None:
        pass
