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

from llmctl.tui.vllm_metrics import VllmMetrics, looks_like_vllm

STATS_PATH = "/v1/engine/stats"
MODELS_STATUS_PATH = "/v1/models/status"
METRICS_PATH = "/metrics"


class SourceError(RuntimeError):
    """The snapshot could not be had; the message says why, in one line. ``kind`` tells the
    dashboard what to call it: "disconnected" (worth retrying), "unauthorized" (the API key),
    "not llmctl" (the server answers, but has nothing top can draw)."""

    def __init__(self, message: str, kind: str = "disconnected") -> None:
        super().__init__(message)
        self.kind = kind


class StatsSource(Protocol):
    label: str  # shown in the dashboard's header: a URL, "local", a file name

    async def fetch(self) -> dict[str, Any] | None: ...

    async def close(self) -> None: ...


class HttpSource:
    """Polls ``GET {url}/v1/engine/stats`` of a running ``llmctl serve``, and its
    ``/v1/models/status`` (what ``llmctl ps`` reads) into the snapshot's ``models_status``; a
    server without stats (vLLM, or anything exporting vLLM's metric names) is drawn from
    ``GET {url}/metrics`` instead."""

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.label = self.url
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s, transport=transport)
        self._metrics: VllmMetrics | None = None  # set once the server turned out to be vLLM-like
        self._models_status = True  # cleared when the server has no /v1/models/status

    async def fetch(self) -> dict[str, Any]:
        if self._metrics is not None:
            return self._metrics.snapshot(await self._get_text(METRICS_PATH))
        response = await self._get(STATS_PATH)
        if response.status_code == 404:
            return await self._fall_back_to_metrics()
        if response.status_code != 200:
            raise SourceError(f"HTTP {response.status_code} from {self.url}{STATS_PATH}")
        try:
            snapshot = response.json()
        except ValueError as exc:
            raise SourceError(f"{self.url}{STATS_PATH} did not answer JSON", "not llmctl") from exc
        if not isinstance(snapshot, dict) or "kv" not in snapshot:
            raise SourceError(f"{self.url}{STATS_PATH} did not answer an engine stats snapshot", "not llmctl")
        if self._models_status:
            status = await self._get(MODELS_STATUS_PATH)
            self._models_status = status.status_code != 404
            if status.status_code == 200:
                snapshot["models_status"] = status.json()
        return snapshot

    async def _fall_back_to_metrics(self) -> dict[str, Any]:
        response = await self._get(METRICS_PATH)
        if response.status_code == 200 and looks_like_vllm(response.text):
            self._metrics = VllmMetrics()
            self.label = f"{self.url} (vLLM /metrics)"
            return self._metrics.snapshot(response.text)
        raise SourceError(
            f"{self.url} is not an llmctl server: it has no {STATS_PATH}, and no vLLM metrics "
            f"at {METRICS_PATH} (HTTP {response.status_code}); nothing to draw",
            "not llmctl",
        )

    async def _get(self, path: str) -> httpx.Response:
        try:
            response = await self._client.get(path)
        except httpx.HTTPError as exc:
            raise SourceError(f"{type(exc).__name__}: {exc or 'no answer'}") from exc
        if response.status_code in (401, 403):
            raise SourceError(
                f"HTTP {response.status_code} from {self.url}{path}: wrong or missing API key "
                "(pass --api-key or set LLMCTL_API_KEY)",
                "unauthorized",
            )
        return response

    async def _get_text(self, path: str) -> str:
        response = await self._get(path)
        if response.status_code != 200:
            raise SourceError(f"HTTP {response.status_code} from {self.url}{path}")
        return response.text

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
