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
    Column("id", "id", _field("id"), lambda r: _natural(r["id"])),
    Column("user", "user", _field("user"), _field("user")),
    Column(
        "state", "state", lambda r: Text(r["state"], style=STATE_STYLES.get(r["state"], "")), _field("state"), width=9
    ),
    Column("prompt", "prompt", _field("prompt_tokens"), _field("prompt_tokens"), width=8),
    Column("generated", "gen", _field("generated_tokens"), _field("generated_tokens"), width=5),
    Column("blocks", "blocks", lambda r: len(r["blocks"]), lambda r: len(r["blocks"]), width=8),
    Column("cached", "cached", _field("cached_tokens"), _field("cached_tokens"), width=8),
    Column("preemptions", "pre", _field("num_preemptions"), _field("num_preemptions"), width=5),
    Column("age", "age s", lambda r: Text(f"{r['age_s']:.1f}", justify="right"), _field("age_s"), width=7),
)
COLUMN_KEYS = tuple(c.key for c in COLUMNS)
BY_KEY = {c.key: c for c in COLUMNS}
# Which columns stay when the table is narrow: the first ones of this list, shown in COLUMNS order.
PRIORITY = ("id", "state", "age", "generated", "prompt", "blocks", "preemptions", "cached", "user")
MIN_ID_WIDTH = 14  # at least this much of a long id (a server's: cmpl- + 32 hex digits) stays visible
MAX_ID_WIDTH = 40
CELL_PADDING = 1  # DataTable's, on each side of every column


def fit_columns(width: int, longest_id: int, longest_user: int) -> tuple[tuple[str, ...], int, int]:
    """The columns that fit in ``width`` cells (by ``PRIORITY``, in display order), the id
    column's width and the user column's. Columns that do not fit are dropped whole, never cut;
    what is left widens the id column up to the longest id."""
    widths = {c.key: c.width for c in COLUMNS}
    min_id = min(MIN_ID_WIDTH, max(4, longest_id))  # short ids ("req-7") take no more than they need
    widths["id"], widths["user"] = min_id, max(4, longest_user)
    chosen: list[str] = []
    used = 0
    for key in PRIORITY:
        need = widths[key] + 2 * CELL_PADDING
        if used + need <= width or key == "id":
            chosen.append(key)
            used += need
    id_width = min(max(min_id, longest_id), min_id + max(0, width - used), MAX_ID_WIDTH)
    return tuple(k for k in COLUMN_KEYS if k in chosen), id_width, widths["user"]


def shorten_id(request_id: str, width: int) -> str:
    """``cmpl-4272…560b#1``: the start and the end stay, which tell a server's ids (and the
    samples of one request) apart."""
    if len(request_id) <= width:
        return request_id
    tail = (width - 1) // 2
    return request_id[: width - 1 - tail] + "…" + request_id[len(request_id) - tail :]


class RequestsTable(DataTable):
    """Enter (or a click) selects the row under the cursor; its blocks light up on the map.

    The columns are fitted to the width: those that do not fit are dropped (lowest ``PRIORITY``
    first) and named in the border's subtitle, so no column is ever shown half-cut."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True, cell_padding=CELL_PADDING)
        self.sort_column = "age"
        self.sort_reverse = True  # oldest first
        self.selected_id: str | None = None
        self.shown_columns: tuple[str, ...] = ()
        self._id_width = MIN_ID_WIDTH
        self._fitted: tuple | None = None
        self._rows: dict[str, tuple] = {}
        self._requests: dict[str, dict[str, Any]] = {}
        self._id_of_cell: dict[str, str] = {}  # shortened id as shown -> request id

    def on_resize(self) -> None:
        self._fit()

    @property
    def hidden(self) -> tuple[str, ...]:
        return tuple(k for k in COLUMN_KEYS if k not in self.shown_columns)

    def _fit(self) -> None:
        """(Re)build the columns when the width, or the longest id or user, asks for others."""
        width = self.scrollable_content_region.width - 1  # the vertical scrollbar may appear
        if width <= 0:
            return
        requests = self._requests.values()
        fit = fit_columns(
            width,
            max((len(r["id"]) for r in requests), default=0),
            max((len(str(r["user"])) for r in requests), default=0),
        )
        shown, id_width, user_width = fit
        if fit == self._fitted:
            return
        self._fitted = fit
        cursor_key = self.cursor_request_id
        self.shown_columns, self._id_width = shown, id_width
        if self.sort_column not in shown:
            self.sort_column, self.sort_reverse = "age", True
        self.clear(columns=True)
        for key in shown:
            width = {"id": id_width, "user": user_width}.get(key, BY_KEY[key].width)
            self.add_column(BY_KEY[key].label, key=key, width=width)
        self._rows = {}
        self.border_subtitle = ("hidden: " + ", ".join(BY_KEY[k].label for k in self.hidden)) if self.hidden else ""
        self._label_headers()
        if self._requests:
            self.show(list(self._requests.values()), cursor_key=cursor_key)

    # ---- data ------------------------------------------------------------------------------------
    def show(self, requests: list[dict[str, Any]], cursor_key: str | None = None) -> None:
        cursor_key = cursor_key or self.cursor_request_id
        self._requests = {r["id"]: r for r in requests}
        if not self.shown_columns:
            return  # not laid out yet: on_resize draws them
        self._fit()
        rows = {r["id"]: self._cells(r) for r in requests}
        for key in [k for k in self._rows if k not in rows]:
            self.remove_row(key)
        for key, cells in rows.items():
            old = self._rows.get(key)
            if old is None:
                self.add_row(*cells, key=key)
            elif old != cells:
                for column, before, after in zip(self.shown_columns, old, cells):
                    if before != after:
                        self.update_cell(key, column, after)
        self._rows = rows
        self._sort()
        if cursor_key in rows:
            self.move_cursor(row=self.get_row_index(cursor_key), scroll=False)

    def _cells(self, request: dict[str, Any]) -> tuple:
        return tuple(
            self._id_cell(request["id"]) if key == "id" else BY_KEY[key].value(request) for key in self.shown_columns
        )

    def _id_cell(self, request_id: str) -> str | Text:
        """The selected request's id is drawn in the map's highlight colour; a long id is shortened."""
        shown = shorten_id(request_id, self._id_width)
        self._id_of_cell[shown] = request_id
        if request_id == self.selected_id:
            return Text(shown, style=f"bold black on {HIGHLIGHT_BG}")
        return shown

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
        value, requests, ids = BY_KEY[self.sort_column].sort_value, self._requests, self._id_of_cell

        def order(cell: Any) -> tuple:
            request_id = ids[str(cell)]
            return value(requests[request_id]), _natural(request_id)  # ties by id: a stable order

        self.sort("id", key=order, reverse=self.sort_reverse)

    def _label_headers(self) -> None:
        """The sort column's header shows the direction."""
        for col in (BY_KEY[k] for k in self.shown_columns):
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

    def next_sort_column(self) -> str:
        """The column after the sort column, among those shown."""
        return self.shown_columns[(self.shown_columns.index(self.sort_column) + 1) % len(self.shown_columns)]
