"""Shared helpers of the dashboard tests: run the app headless, read what a widget shows."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from textual.geometry import Region
from textual.widget import Widget

from llmctl.tui.app import TopApp
from llmctl.tui.sources import ReplaySource, SourceError

FIXTURE = Path(__file__).parent / "fixtures" / "snapshots.jsonl"
SIZE = (160, 48)


def load_snapshots() -> list[dict[str, Any]]:
    return [json.loads(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


def drive(app: TopApp, scenario: Callable[[TopApp, Any], Awaitable[None]], size: tuple[int, int] = SIZE) -> None:
    """Run ``scenario(app, pilot)`` inside ``app.run_test`` (headless)."""

    async def main() -> None:
        async with app.run_test(size=size) as pilot:
            await scenario(app, pilot)

    asyncio.run(main())


def shown_text(widget: Widget) -> str:
    """The widget's rendered lines (what the terminal gets), as plain text."""
    width, height = widget.outer_size
    return "\n".join(strip.text for strip in widget.render_lines(Region(0, 0, width, height)))


class FlakySource(ReplaySource):
    """A replay whose fetches fail while ``down`` is set, like a server that went away."""

    def __init__(self, snapshots: list[dict[str, Any]]) -> None:
        super().__init__(snapshots, label="flaky")
        self.down = False
        self.fetches = 0

    async def fetch(self) -> dict[str, Any] | None:
        self.fetches += 1
        if self.down:
            raise SourceError("ConnectError: [Errno 111] Connection refused")
        return await super().fetch()


def screen_text(app: TopApp) -> str:
    """The whole screen as plain text, one line per terminal row (a text snapshot of the app).
    Textual's compositor is what a real terminal gets its lines from."""
    return "\n".join(strip.text.rstrip() for strip in app.screen._compositor.render_strips())


async def settled_screen_text(app: TopApp, pilot: Any, timeout_s: float = 2.0) -> str:
    """``screen_text`` once the footer on the last row shows its keys: the footer composes them
    after a refresh of its own, and on a loaded machine one pause can find that row still blank
    (seen in CI: 59 lines of a 60-row screen). A footer that never shows fails the caller's checks."""
    text = screen_text(app)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not text.split("\n")[-1].strip() and asyncio.get_running_loop().time() < deadline:
        await pilot.pause(0.02)
        text = screen_text(app)
    return text
