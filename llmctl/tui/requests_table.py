"""The live requests table: one row per running or waiting sequence, sortable, one selectable.

Rows are updated in place (cells that changed, rows that came or went) and reordered with
``DataTable.sort``, so the scroll position and the cursor's request survive every refresh.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.text import Text
from textual.widgets import DataTable

from llmctl.tui.blockmap import HIGHLIGHT_BG

STATE_STYLES = {"running": "green3", "waiting": "yellow3", "preempted": "red1"}


def _natural(text: str) -> tuple:
    """'req-10' after 'req-9'."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    value: Callable[[dict[str, Any]], Any]  # the cell shown, from the request's snapshot entry
    sort_value: Callable[[dict[str, Any]], Any]  # what sorting compares (exact, not the rounded cell)
    width: int | None = None  # fixed, so updates never re-measure a column; None: fit the rows as they come


def _field(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r[name]


COLUMNS = (
    # fixed width: a server's ids (cmpl- + 32 hex digits) would push the other columns off screen
    Column("id", "id", _field("id"), lambda r: _natural(r["id"]), width=18),
    Column("user", "user", _field("user"), _field("user")),
    Column("state", "state", lambda r: Text(r["state"], style=STATE_STYLES.get(r["state"], "")), _field("state"),
           width=9),
    Column("prompt", "prompt", _field("prompt_tokens"), _field("prompt_tokens"), width=8),
    Column("generated", "gen", _field("generated_tokens"), _field("generated_tokens"), width=7),
    Column("blocks", "blocks", lambda r: len(r["blocks"]), lambda r: len(r["blocks"]), width=8),
    Column("cached", "cached", _field("cached_tokens"), _field("cached_tokens"), width=8),
    Column("preemptions", "pre", _field("num_preemptions"), _field("num_preemptions"), width=5),
    Column("age", "age s", lambda r: Text(f"{r['age_s']:.1f}", justify="right"), _field("age_s"), width=8),
)
COLUMN_KEYS = tuple(c.key for c in COLUMNS)
BY_KEY = {c.key: c for c in COLUMNS}


class RequestsTable(DataTable):
    """Enter (or a click) selects the row under the cursor; its blocks light up on the map."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True)
        self.sort_column = "age"
        self.sort_reverse = True  # oldest first
        self.selected_id: str | None = None
        self._rows: dict[str, tuple] = {}
        self._requests: dict[str, dict[str, Any]] = {}

    def on_mount(self) -> None:
        for column in COLUMNS:
            self.add_column(column.label, key=column.key, width=column.width)
        self._label_headers()

    # ---- data ------------------------------------------------------------------------------------
    def show(self, requests: list[dict[str, Any]]) -> None:
        cursor_key = self.cursor_request_id
        self._requests = {r["id"]: r for r in requests}
        rows = {r["id"]: self._cells(r) for r in requests}
        for key in [k for k in self._rows if k not in rows]:
            self.remove_row(key)
        for key, cells in rows.items():
            old = self._rows.get(key)
            if old is None:
                self.add_row(*cells, key=key)
            elif old != cells:
                for column, before, after in zip(COLUMN_KEYS, old, cells):
                    if before != after:
                        self.update_cell(key, column, after)
        self._rows = rows
        self._sort()
        if cursor_key in rows:
            self.move_cursor(row=self.get_row_index(cursor_key), scroll=False)

    def _cells(self, request: dict[str, Any]) -> tuple:
        return (self._id_cell(request["id"]), *(c.value(request) for c in COLUMNS[1:]))

    def _id_cell(self, request_id: str) -> str | Text:
        """The selected request's id is drawn in the map's highlight colour."""
        if request_id == self.selected_id:
            return Text(request_id, style=f"bold black on {HIGHLIGHT_BG}")
        return request_id

    @property
    def row_ids(self) -> list[str]:
        """Request ids in display order."""
        return [row.key.value for row in self.ordered_rows]

    @property
    def cursor_request_id(self) -> str | None:
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value

    # ---- sorting ---------------------------------------------------------------------------------
    def sort_by(self, column: str, reverse: bool | None = None) -> None:
        """Sort by ``column``; choosing the current column again flips the order."""
        if reverse is None:
            reverse = not self.sort_reverse if column == self.sort_column else column in ("age", "blocks", "generated")
        self.sort_column, self.sort_reverse = column, reverse
        cursor_key = self.cursor_request_id
        self._sort()
        self._label_headers()
        if cursor_key is not None:
            self.move_cursor(row=self.get_row_index(cursor_key))

    def _sort(self) -> None:
        value, requests = BY_KEY[self.sort_column].sort_value, self._requests
        # ties by id, so equal rows keep a stable order between refreshes
        self.sort("id", key=lambda cell: (value(requests[str(cell)]), _natural(str(cell))), reverse=self.sort_reverse)

    def _label_headers(self) -> None:
        """The sort column's header shows the direction."""
        for col in COLUMNS:
            label = Text(col.label + ((" ▼" if self.sort_reverse else " ▲") if col.key == self.sort_column else ""))
            column = self.columns[col.key]
            column.label = label
            column.content_width = max(column.content_width, label.cell_len)
        self.refresh()

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(event.column_key.value)

    # ---- selection -------------------------------------------------------------------------------
    def select(self, request_id: str | None) -> None:
        """Select a request (``None`` clears); the id cell of the selected row is highlighted."""
        previous, self.selected_id = self.selected_id, request_id
        for key in (previous, request_id):
            if key is not None and key in self._rows:
                self._rows[key] = (self._id_cell(key), *self._rows[key][1:])
                self.update_cell(key, "id", self._rows[key][0])
