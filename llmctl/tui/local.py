"""``llmctl top --local``: an in-process engine under a synthetic load, as a snapshot source."""

from __future__ import annotations

import asyncio
from typing import Any

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine
from llmctl.tui.load import LoadProfile, SyntheticLoad
from llmctl.tui.sources import SourceError


class LocalSource:
    """Takes a built engine (so a bad option fails before the screen opens); starts its loop and
    the load on the first fetch, inside the dashboard's event loop where the load's request streams
    must live; snapshots the engine from a worker thread, so a long step never freezes the screen."""

    label = "local engine · synthetic load"

    def __init__(self, engine: LLMEngine, profile: LoadProfile | None = None) -> None:
        self.engine = engine
        self.profile = profile or LoadProfile(seed=engine.config.seed)
        self.async_engine: AsyncEngine | None = None
        self.load: SyntheticLoad | None = None
        self._load_task: asyncio.Task | None = None

    async def start(self) -> None:
        self.async_engine = AsyncEngine(self.engine).start()
        self.load = SyntheticLoad(self.async_engine, self.profile)
        self._load_task = asyncio.create_task(self.load.run())

    async def fetch(self) -> dict[str, Any]:
        if self.async_engine is None:
            await self.start()
        assert self.async_engine is not None and self.load is not None
        if self.async_engine.is_dead:
            raise SourceError(f"the local engine stopped: {self.async_engine.dead_error}")
        return await asyncio.to_thread(self.async_engine.stats_snapshot)

    async def close(self) -> None:
        if self._load_task is not None:
            self._load_task.cancel()
            await asyncio.gather(self._load_task, return_exceptions=True)
        if self.load is not None:
            await self.load.stop()
        if self.async_engine is not None:
            await asyncio.to_thread(self.async_engine.shutdown)
            self.async_engine = None
