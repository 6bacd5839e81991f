"""``llmctl top`` driven headless with snapshots recorded from a real engine run: each panel must
show what the snapshot says."""

from __future__ import annotations

from collections import Counter

from rich.segment import Segment
from tui_helpers import FlakySource, drive, shown_text

from llmctl.tui.app import HelpScreen, TopApp
from llmctl.tui.blockmap import HIGHLIGHT_BG, STATE_COLORS, BlockMap, group_states
from llmctl.tui.panels import format_rate, format_seconds
from llmctl.tui.requests_table import RequestsTable
from llmctl.tui.sources import ReplaySource
from llmctl.tui.stepbars import DECODE_COLOR, PREFILL_COLOR, StepBars
from llmctl.tui.synthetic import synthetic_snapshot

COLOR_STATE = {color: state for state, color in STATE_COLORS.items()}


def rendered_cells(block_map: BlockMap) -> list[tuple[str, bool]]:
    """(state, highlighted) of every cell drawn, read back from the rendered segments' colours."""
    cells = []
    for y in range(block_map.size.height):
        for segment in block_map.render_line(y):
            segment: Segment
            if not segment.text.strip():
                continue
            style = segment.style
            for i in range(0, len(segment.text), block_map.cell_width):
                highlighted = style.bgcolor is not None and style.bgcolor.name == HIGHLIGHT_BG
                state = "." if segment.text[i] == "·" else COLOR_STATE[style.color.name]
                cells.append((state, highlighted))
    return cells


def cell_at(strip, column: int):
    """(glyph, style) of one column of a rendered line."""
    x = 0
    for segment in strip:
        if x + len(segment.text) > column:
            return segment.text[column - x], segment.style
        x += len(segment.text)
    raise IndexError(column)


async def feed(app: TopApp, count: int, pilot) -> None:
    for _ in range(count):
        await app.poll_once()
    await pilot.pause()


def test_block_map_shows_every_block_in_its_state_colour(snapshots):
    async def scenario(app, pilot):
        for index in (0, 8):  # the pool filling up (free blocks), then full with cached ones
            app.source.position = index
            await feed(app, 1, pilot)
            snap = snapshots[index]
            block_map = app.query_one(BlockMap)
            assert block_map.group_size == 1 and block_map.cells == snap["kv"]["block_states"]
            cells = rendered_cells(block_map)
            assert "".join(state for state, _ in cells) == snap["kv"]["block_states"]
            assert not any(highlighted for _, highlighted in cells)
            counts = Counter(state for state, _ in cells)
            kv = snap["kv"]
            assert [counts[s] for s in ".cus"] == [kv["free"], kv["cached"], kv["used"], kv["shared"]]
            summary = shown_text(app.query_one("#kv-summary"))
            assert f"usage {100 * kv['usage']:.1f}%" in summary
            assert f"{kv['used']:,} used" in summary and f"{kv['shared']:,} shared" in summary
            assert f"prefix hit {100 * snap['prefix_cache']['hit_rate']:.1f}%" in summary
            assert f"{kv['num_blocks']:,} blocks × 16 tokens" in app.query_one("#kv").border_title

    drive(TopApp(ReplaySource(snapshots), interval=None), scenario)


def test_batch_panel_shows_the_last_steps(snapshots):
    async def scenario(app, pilot):
        await feed(app, 3, pilot)  # steps 1..36, merged from three snapshots
        steps = snapshots[2]["steps"]
        bars = app.query_one(StepBars)
        shown = [(s["step"], s["prefill_tokens"], s["decode_tokens"]) for s in steps][-bars.size.width :]
        assert bars.shown == shown
        assert bars.scale == max(p + d for _, p, d in shown)
        last = steps[-1]
        summary = shown_text(app.query_one("#batch-summary"))
        assert f"step {last['step']}: prefill {last['prefill_tokens']} · decode {last['decode_tokens']}" in summary
        assert f"{last['num_seqs']} seqs" in summary
        sched = snapshots[2]["scheduler"]
        assert f"running {sched['running']}" in summary
        assert f"preempted {sched['preempted_waiting']}" in summary
        # the tallest bar fills its top cell: a full block, or prefill ending under a decode background
        tallest = max(range(len(shown)), key=lambda i: shown[i][1] + shown[i][2])
        column = bars.size.width - len(shown) + tallest
        glyph, style = cell_at(bars.render_line(0), column)
        assert glyph == "█" or style.bgcolor.name == DECODE_COLOR
        # a step with no prefill is all decode colour, a step with no tokens is blank at the bottom
        for i, (_, prefill, decode) in enumerate(shown):
            glyph, style = cell_at(bars.render_line(bars.size.height - 1), bars.size.width - len(shown) + i)
            if prefill + decode == 0:
                assert glyph == " "
            elif prefill == 0:
                assert style.color.name == DECODE_COLOR and style.bgcolor is None
            else:
                assert style.color.name == PREFILL_COLOR
        # four more snapshots: the merged history keeps every step once, in order
        await feed(app, 4, pilot)
        numbers = [s["step"] for s in app.state.steps]
        assert numbers == list(range(1, snapshots[6]["step"] + 1))

    drive(TopApp(ReplaySource(snapshots), interval=None), scenario)


def test_requests_table_rows_sorting_and_selection_highlight(snapshots):
    snap = snapshots[6]

    async def scenario(app, pilot):
        app.source.position = 6
        await feed(app, 1, pilot)
        table = app.query_one(RequestsTable)
        by_id = {r["id"]: r for r in snap["requests"]}
        assert sorted(table.row_ids) == sorted(by_id)
        for request_id in table.row_ids:
            row = table.get_row(request_id)
            request = by_id[request_id]
            assert [str(row[0]), row[1], str(row[2]), row[3], row[4], row[5], row[6]] == [
                request["id"],
                request["user"],
                request["state"],
                request["prompt_tokens"],
                request["generated_tokens"],
                len(request["blocks"]),
                request["cached_tokens"],
            ]
        # default order: oldest first
        ages = [by_id[i]["age_s"] for i in table.row_ids]
        assert ages == sorted(ages, reverse=True)
        assert "Requests (25)" in table.border_title
        text = shown_text(table)
        assert "age s ▼" in text and table.row_ids[0] in text

        # s moves the sort to the next column (after age: id), a header click sorts by that column,
        # r reverses
        await pilot.press("s")
        assert table.sort_column == "id"
        numbers = [int(i.split("-")[1].split("#")[0]) for i in table.row_ids]
        assert numbers == sorted(numbers)
        header = shown_text(table).splitlines()[1]  # under the border
        await pilot.click(RequestsTable, offset=(header.index("prompt") + 1, 1))
        await pilot.pause()
        assert table.sort_column == "prompt"
        prompts = [by_id[i]["prompt_tokens"] for i in table.row_ids]
        assert prompts == sorted(prompts)
        await pilot.press("r")
        prompts = [by_id[i]["prompt_tokens"] for i in table.row_ids]
        assert prompts == sorted(prompts, reverse=True)
        assert "prompt ▼" in shown_text(table)

        # select the first running request that holds blocks
        target = next(i for i in table.row_ids if by_id[i]["blocks"])
        table.focus()
        table.move_cursor(row=table.get_row_index(target))
        await pilot.press("enter")
        assert app.selected_id == target
        block_map = app.query_one(BlockMap)
        cells = rendered_cells(block_map)
        lit = {i for i, (_, highlighted) in enumerate(cells) if highlighted}
        assert lit == set(by_id[target]["blocks"])
        assert "".join(s for s, _ in cells) == snap["kv"]["block_states"]  # colours kept under the highlight
        legend = shown_text(app.query_one("#kv-legend"))
        assert f"selected: {target} holds {len(by_id[target]['blocks'])} blocks" in legend
        # sorting again keeps the cursor on the selected request
        await pilot.press("s")
        assert table.cursor_request_id == target
        # escape clears the highlight
        await pilot.press("escape")
        assert app.selected_id is None
        assert not any(h for _, h in rendered_cells(block_map))

    drive(TopApp(ReplaySource(snapshots), interval=None), scenario)


def test_selection_clears_when_the_request_finishes(snapshots):
    async def scenario(app, pilot):
        app.source.position = 6
        await feed(app, 1, pilot)
        later_ids = {r["id"] for r in snapshots[16]["requests"]}
        gone = next(r["id"] for r in snapshots[6]["requests"] if r["id"] not in later_ids and r["blocks"])
        table = app.query_one(RequestsTable)
        table.focus()
        table.move_cursor(row=table.get_row_index(gone))
        await pilot.press("enter")
        assert app.query_one(BlockMap).highlighted
        app.source.position = 16
        await feed(app, 1, pilot)
        assert app.selected_id is None and not app.query_one(BlockMap).highlighted
        assert gone not in table.row_ids

    drive(TopApp(ReplaySource(snapshots), interval=None), scenario)


def test_throughput_from_counter_deltas_and_latency_section(snapshots):
    async def scenario(app, pilot):
        await feed(app, 1, pilot)
        assert "output tokens/s n/a" in shown_text(app.query_one("#out-rate"))  # one snapshot: no rate yet
        await feed(app, 2, pilot)
        a, b = snapshots[1], snapshots[2]
        dt = b["time"] - a["time"]
        tokens = (b["counters"]["generation_tokens_total"] - a["counters"]["generation_tokens_total"]) / dt
        finished_a, finished_b = (sum(s["counters"]["requests_finished"].values()) for s in (a, b))
        finished = (finished_b - finished_a) / dt
        prefill = sum(s["prefill_tokens"] for s in b["steps"] if s["step"] > a["step"]) / dt
        assert f"output tokens/s {format_rate(tokens)}" in shown_text(app.query_one("#out-rate"))
        assert f"finished requests/s {format_rate(finished)}" in shown_text(app.query_one("#req-rate"))
        assert f"prefill tokens/s {format_rate(prefill)}" in shown_text(app.query_one("#prefill-rate"))
        assert list(app.query_one("#out-sparkline").data) == list(app.state.output_tokens_per_s)
        latency = shown_text(app.query_one("#latency"))
        ttft = b["latency"]["ttft_s"]
        assert "TTFT" in latency and format_seconds(ttft["p50"]) in latency and format_seconds(ttft["p99"]) in latency
        assert f"last {b['latency']['count']} finished requests" in latency

    drive(TopApp(ReplaySource(snapshots), interval=None), scenario)


def test_latency_is_na_when_the_snapshot_has_none(snapshots):
    bare = [{k: v for k, v in s.items() if k != "latency"} for s in snapshots[:2]]

    async def scenario(app, pilot):
        await feed(app, 2, pilot)
        assert "TTFT n/a · TPOT n/a" in shown_text(app.query_one("#latency"))

    drive(TopApp(ReplaySource(bare), interval=None), scenario)


def test_keys_pause_help_and_quit(snapshots):
    async def scenario(app, pilot):
        await feed(app, 1, pilot)
        await pilot.press("p")
        assert app.paused and "PAUSED" in shown_text(app.query_one("#status"))
        await app.poll_once()
        assert app.source.position == 1  # paused: nothing fetched
        await pilot.press("p")
        await app.poll_once()
        assert not app.paused and app.source.position == 2
        assert "● live" in shown_text(app.query_one("#status"))
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        assert "one cell per block" in shown_text(app.screen.query_one("#help-text"))
        await pilot.press("x")  # any key closes the help
        assert not isinstance(app.screen, HelpScreen)
        await pilot.press("q")
        await pilot.pause()
        assert app.return_code == 0 and not app.is_running

    drive(TopApp(ReplaySource(snapshots), interval=None), scenario)


def test_disconnected_banner_greys_the_data_then_recovers(snapshots):
    async def scenario(app, pilot):
        await feed(app, 2, pilot)
        banner, body = app.query_one("#banner"), app.query_one("#body")
        assert not banner.display
        app.source.down = True
        await feed(app, 2, pilot)
        assert banner.display
        assert "disconnected — retrying" in shown_text(banner) and "Connection refused" in shown_text(banner)
        assert body.has_class("-stale") and app.query_one(BlockMap).stale
        assert app.state.snapshot is snapshots[1]  # the last data stays on screen
        assert app.query_one(RequestsTable).row_count == len(snapshots[1]["requests"])
        assert "● live" not in shown_text(app.query_one("#status"))
        app.source.down = False
        await feed(app, 1, pilot)
        assert not banner.display and not body.has_class("-stale") and not app.query_one(BlockMap).stale
        assert app.state.snapshot is snapshots[2]
        assert app.query_one(RequestsTable).row_count == len(snapshots[2]["requests"])
        assert app.source.fetches == 5

    drive(TopApp(FlakySource(snapshots), interval=None), scenario)


def test_timer_polls_by_itself(snapshots):
    async def scenario(app, pilot):
        # A 0.1 s timer, nothing else driving it: 3 polls must come. Waited for up to 10 s rather than
        # counted after a fixed pause (a fresh-clone CI run on 2 busy cores saw 2 polls in 0.6 s).
        for _ in range(100):
            if app.source.position >= 3:
                break
            await pilot.pause(0.1)
        assert app.source.position >= 3
        assert app.state.snapshot is snapshots[app.source.position - 1]

    drive(TopApp(ReplaySource(snapshots), interval=0.1), scenario)


def test_a_large_pool_is_drawn_in_groups():
    big = synthetic_snapshot(4096, 256)

    async def scenario(app, pilot):
        await feed(app, 1, pilot)
        block_map = app.query_one(BlockMap)
        width, height = block_map.size
        assert block_map.cell_width == 1 and block_map.group_size == -(-4096 // (width * height))
        assert block_map.cells == group_states(big["kv"]["block_states"], block_map.group_size)
        for y in range(height):
            assert block_map.render_line(y).cell_length == width
        cells = rendered_cells(block_map)
        assert "".join(s for s, _ in cells) == block_map.cells
        assert f"1 cell = {block_map.group_size} blocks" in shown_text(app.query_one("#kv-legend"))
        target = big["requests"][3]
        table = app.query_one(RequestsTable)
        table.focus()
        table.move_cursor(row=table.get_row_index(target["id"]))
        await pilot.press("enter")
        lit = {i for i, (_, highlighted) in enumerate(rendered_cells(block_map)) if highlighted}
        assert lit == {b // block_map.group_size for b in target["blocks"]}
        assert app.query_one(RequestsTable).row_count == 256

    drive(TopApp(ReplaySource([big]), interval=None), scenario)
