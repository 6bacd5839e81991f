"""The KV block map: one cell per block, or per group of blocks when the pool outgrows the panel.

A group's cell shows the most important state among its blocks, in the order
shared > used > cached > free: a single shared block is never hidden by its free neighbours, and
a cell only looks free when every block in it is free. The selected request's blocks are drawn
highlighted (a group is highlighted when it holds any of them).

Rendering is one ``render_line`` per row that run-length merges cells of one style into a single
segment, so a 4,096-block pool costs a few hundred segments per frame, not thousands of widgets.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

FREE, CACHED, USED, SHARED = ".", "c", "u", "s"
IMPORTANCE = {FREE: 0, CACHED: 1, USED: 2, SHARED: 3}
STATE_NAMES = {FREE: "free", CACHED: "cached (evictable)", USED: "used by one sequence", SHARED: "shared (ref > 1)"}
STATE_COLORS = {FREE: "grey42", CACHED: "dodger_blue1", USED: "green3", SHARED: "magenta1"}
GLYPHS = {FREE: "·", CACHED: "■", USED: "■", SHARED: "■"}
HIGHLIGHT_BG = "yellow1"
STALE_COLOR = "grey35"


def group_states(states: str, group_size: int) -> str:
    """One character per group of ``group_size`` consecutive blocks: its most important state."""
    if group_size <= 1:
        return states
    rank = IMPORTANCE.__getitem__
    return "".join(max(states[i : i + group_size], key=rank) for i in range(0, len(states), group_size))


def highlighted_cells(blocks: Iterable[int], group_size: int) -> set[int]:
    return {b // max(1, group_size) for b in blocks}


def layout(num_blocks: int, width: int, height: int) -> tuple[int, int, int]:
    """(cell width in columns, row pitch in lines, blocks per cell) so the whole pool fits
    ``width`` x ``height``: two columns per cell (a visible grid) when there is room, and a blank
    line between rows when there is room for that too; else one column; else groups of blocks."""
    width, height = max(1, width), max(1, height)
    if num_blocks <= (width // 2) * height:
        rows = -(-num_blocks // max(1, width // 2))
        return 2, (2 if 2 * rows - 1 <= height else 1), 1
    capacity = width * height
    return 1, 1, max(1, -(-num_blocks // capacity))


@lru_cache(maxsize=64)
def cell_style(state: str, highlighted: bool, stale: bool) -> Style:
    if stale:
        return Style(color=STALE_COLOR, bgcolor="grey19" if highlighted else None)
    if highlighted:
        return Style(color="black" if state == FREE else STATE_COLORS[state], bgcolor=HIGHLIGHT_BG, bold=True)
    return Style(color=STATE_COLORS[state])


class BlockMap(Widget):
    """Draws ``block_states`` (the snapshot's one-char-per-block string)."""

    DEFAULT_CSS = "BlockMap { height: 1fr; min-height: 3; }"

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.states = ""
        self.selected_blocks: frozenset[int] = frozenset()
        self.stale = False
        # the current layout, recomputed when the data or the size changes; tests read these
        self.cell_width = 2
        self.row_pitch = 1
        self.group_size = 1
        self.cells = ""
        self.highlighted: set[int] = set()
        self._layout_key: tuple | None = None
        self._row_cache: dict[int, Strip] = {}

    def update_map(self, states: str, selected_blocks: Iterable[int] = (), stale: bool = False) -> None:
        selected = frozenset(selected_blocks)
        if (states, selected, stale) == (self.states, self.selected_blocks, self.stale):
            return
        self.states, self.selected_blocks, self.stale = states, selected, stale
        self._layout_key = None
        self._ensure_layout()  # so group_size is current for the caller's legend
        self.refresh()

    def _ensure_layout(self) -> None:
        width, height = self.size.width, self.size.height
        key = (width, height)
        if self._layout_key == key:
            return
        self.cell_width, self.row_pitch, self.group_size = layout(len(self.states), width, height)
        self.cells = group_states(self.states, self.group_size)
        self.highlighted = highlighted_cells(self.selected_blocks, self.group_size)
        self._row_cache.clear()
        self._layout_key = key

    @property
    def cells_per_row(self) -> int:
        return max(1, self.size.width // self.cell_width)

    def render_line(self, y: int) -> Strip:
        self._ensure_layout()
        strip = self._row_cache.get(y)
        if strip is None:
            strip = self._render_row(y)
            self._row_cache[y] = strip
        return strip

    def _render_row(self, y: int) -> Strip:
        if y % self.row_pitch:
            return Strip.blank(self.size.width)
        per_row = self.cells_per_row
        start = y // self.row_pitch * per_row
        row = self.cells[start : start + per_row]
        if not row:
            return Strip.blank(self.size.width)
        pad = " " * (self.cell_width - 1)
        segments: list[Segment] = []
        run_text, run_style = "", None
        for offset, state in enumerate(row):
            style = cell_style(state, start + offset in self.highlighted, self.stale)
            text = GLYPHS[state] + pad
            if style == run_style:
                run_text += text
            else:
                if run_text:
                    segments.append(Segment(run_text, run_style))
                run_text, run_style = text, style
        segments.append(Segment(run_text, run_style))
        return Strip(segments).adjust_cell_length(self.size.width)
