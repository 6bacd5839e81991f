"""``llmctl top`` at common terminal sizes: text snapshots at 80x24, 120x40 and 200x60.

Each size must show every column that the sort cycles through, whole (a column that does not
fit is dropped and named under the table, never cut), and the connection state in the header.
The snapshots live in fixtures/layout_WxH.txt; ``LLMCTL_UPDATE_SNAPSHOTS=1`` rewrites them
(look at the diff before committing it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tui_helpers import drive, settled_screen_text

from llmctl.tui.app import TopApp
from llmctl.tui.requests_table import BY_KEY, COLUMN_KEYS, RequestsTable, fit_columns, shorten_id
from llmctl.tui.sources import ReplaySource

FIXTURES = Path(__file__).parent / "fixtures"
SIZES = [(80, 24), (120, 40), (200, 60)]


def _header_labels(header_row: str) -> list[str]:
    return header_row.strip("│ ").replace(" ▼", "").replace(" ▲", "").split()


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_layout_at_common_sizes(snapshots, size):
    width, height = size

    async def scenario(app, pilot):
        for _ in range(7):
            await app.poll_once()
        await pilot.pause()
        text = await settled_screen_text(app, pilot)
        lines = text.splitlines()
        assert len(lines) == height and all(len(line) <= width for line in lines)
        assert lines[0].lstrip().startswith("● live  llmctl top")  # the state is never cut

        table = app.query_one(RequestsTable)
        shown, hidden = table.shown_columns, table.hidden
        assert set(shown) | set(hidden) == set(COLUMN_KEYS) and {"id", "state", "age"} <= set(shown)
        table_lines = [line for line in lines if "Requests (25)" in line]
        header = lines[lines.index(table_lines[0]) + 1]
        left = header[: header.index("││") + 1] if "││" in header else header
        assert _header_labels(left) == " ".join(BY_KEY[k].label for k in shown).split()
        if hidden:  # the marker names what was dropped
            assert f"hidden: {', '.join(BY_KEY[k].label for k in hidden)}" in text
        else:
            assert "hidden:" not in text
        if width >= 120:
            assert {"preemptions", "age", "prompt", "blocks", "cached"} <= set(shown)
        if width >= 200:
            assert hidden == ()

        # s cycles through the shown columns only, back to the default sort
        seen = []
        for _ in shown:
            await pilot.press("s")
            seen.append(table.sort_column)
        assert sorted(seen) == sorted(shown) and seen[-1] == "age"

        snapshot_file = FIXTURES / f"layout_{width}x{height}.txt"
        if os.environ.get("LLMCTL_UPDATE_SNAPSHOTS"):
            snapshot_file.write_text(text + "\n")
        assert text + "\n" == snapshot_file.read_text()

    drive(TopApp(ReplaySource(snapshots, label="http://127.0.0.1:8000"), interval=None), scenario, size=size)


def test_a_servers_long_ids_keep_both_ends():
    server_id = "cmpl-427286bb7a924d0f8c560b0e1a2b3c4d#1"  # cmpl- + 32 hex digits, sample 1 of n
    shown, id_width, _ = fit_columns(76, len(server_id), 8)  # the table's width at 120 columns
    assert id_width >= 14 and {"id", "state", "age"} <= set(shown)
    short = shorten_id(server_id, id_width)
    assert len(short) == id_width and short.startswith("cmpl-4") and short.endswith("c4d#1") and "…" in short
    assert shorten_id("req-7", 14) == "req-7"
    shown, id_width, _ = fit_columns(200, len(server_id), 8)
    assert id_width == len(server_id) and set(shown) == set(COLUMN_KEYS)  # room enough: the whole id
