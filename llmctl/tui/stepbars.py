"""Batch composition as stacked bars: one column per engine step (newest on the right), prefill
tokens at the bottom, decode tokens on top, all scaled to the tallest step shown.

Bars have eighth-of-a-cell resolution; where prefill ends inside a cell, the cell is a lower-block
glyph in the prefill colour on a decode-coloured background, so the boundary stays visible.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

PREFILL_COLOR = "dark_orange"
DECODE_COLOR = "green3"
STALE_COLORS = ("grey50", "grey35")
EIGHTHS = " ▁▂▃▄▅▆▇█"


def bar_cell(prefill8: int, total8: int, row: int) -> tuple[str, str | None, str | None]:
    """(glyph, which colour is the glyph, which is the background) for one cell of a bar, ``row``
    counted from the bottom; heights in eighths of a cell. Colours are "p", "d" or None."""
    low = 8 * row
    p = min(max(prefill8 - low, 0), 8)
    t = min(max(total8 - low, 0), 8)
    if t == 0:
        return " ", None, None
    if p == 8:
        return "█", "p", None
    if p == 0:
        return EIGHTHS[t], "d", None
    return EIGHTHS[p], "p", ("d" if t > p else None)


@lru_cache(maxsize=16)
def _style(color: str | None, bgcolor: str | None) -> Style:
    return Style(color=color, bgcolor=bgcolor)


class StepBars(Widget):
    DEFAULT_CSS = "StepBars { height: 1fr; min-height: 3; }"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.steps: list[dict[str, Any]] = []
        self.stale = False
        self.shown: list[tuple[int, int, int]] = []  # (step, prefill, decode) of the drawn columns
        self.scale = 0  # tokens of the tallest bar drawn
        self._heights: list[tuple[int, int]] = []
        self._key: tuple | None = None

    def update_steps(self, steps: list[dict[str, Any]], stale: bool = False) -> None:
        self.steps, self.stale = list(steps), stale
        self._key = None
        self.refresh()

    def _ensure_layout(self) -> None:
        key = (self.size.width, self.size.height)
        if key == self._key:
            return
        width, height = max(1, self.size.width), max(1, self.size.height)
        self.shown = [(s["step"], s["prefill_tokens"], s["decode_tokens"]) for s in self.steps[-width:]]
        self.scale = max((p + d for _, p, d in self.shown), default=0)
        full = 8 * height
        self._heights = []
        for _, prefill, decode in self.shown:
            if not self.scale or not prefill + decode:
                self._heights.append((0, 0))
                continue
            total8 = max(1, round((prefill + decode) / self.scale * full))
            prefill8 = round(prefill / self.scale * full)
            prefill8 = min(max(prefill8, 1 if prefill else 0), total8 - (1 if decode and total8 > 1 else 0))
            self._heights.append((prefill8, total8))
        self._key = key

    def render_line(self, y: int) -> Strip:
        self._ensure_layout()
        height, width = self.size.height, self.size.width
        row = height - 1 - y
        colors = dict(zip("pd", STALE_COLORS if self.stale else (PREFILL_COLOR, DECODE_COLOR)))
        segments = [Segment(" " * (width - len(self._heights)))] if len(self._heights) < width else []
        for prefill8, total8 in self._heights:
            glyph, fg, bg = bar_cell(prefill8, total8, row)
            style = _style(colors.get(fg), colors.get(bg)) if fg else None
            segments.append(Segment(glyph, style))
        return Strip(Segment.simplify(segments)).adjust_cell_length(width)
