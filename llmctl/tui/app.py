"""``llmctl top``: the Textual app that polls a ``StatsSource`` and draws the engine live.

Polling runs on a timer; each tick fetches one snapshot, folds it into the ``DashboardState`` and
redraws. A failing fetch never stops the app: the last data stays on screen, greyed, under a
"disconnected — retrying" banner, and the next successful fetch brings it back to life.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Static

from llmctl.tui.blockmap import STATE_COLORS, STATE_NAMES
from llmctl.tui.experts import ExpertPanel
from llmctl.tui.models import ModelsPanel
from llmctl.tui.panels import BatchPanel, KvPanel, Line, ThroughputPanel
from llmctl.tui.requests_table import RequestsTable
from llmctl.tui.sources import SourceError, StatsSource
from llmctl.tui.state import DashboardState

HELP = """\
[b]llmctl top[/b] — the engine, live

[b]KV cache[/b]  one cell per block (per group of blocks when the pool is larger than the panel;
          a group shows its busiest block: shared > used > cached > free)
{legend}
[b]Batch composition[/b]  one bar per engine step, newest on the right: prefill tokens (orange)
          under decode tokens (green); sequences per step below; running / waiting / preempted
[b]Throughput[/b]  output, prefill tokens/s and finished requests/s between snapshots;
          TTFT / TPOT / end-to-end percentiles when the server reports them
[b]Requests[/b]  every live sequence; ↑/↓ move, [b]enter[/b] selects (its blocks light up), [b]s[/b] next sort
          column, [b]r[/b] reverse order, a click on a header sorts by it, [b]escape[/b] clears the selection
[b]Expert load[/b]  a mixture-of-experts model only: tokens per expert over the last passes (all MoE
          layers), the busiest first, and the share of expert weight bytes a pass reads
[b]Models[/b]  a server of several models only: the table `llmctl ps` shows

[b]q[/b] quit   [b]p[/b] pause / resume   [b]?[/b] this help (any key closes it)
"""


class HelpScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Static { width: auto; max-width: 100; padding: 1 2; border: round $accent; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        legend = "\n".join(f"          [{STATE_COLORS[s]}]■[/] {name}" for s, name in STATE_NAMES.items())
        yield Static(HELP.format(legend=legend), id="help-text")

    def on_key(self, event) -> None:
        event.stop()
        self.dismiss()


class TopApp(App[None]):
    TITLE = "llmctl top"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #status { height: 1; background: $boost; padding: 0 1; }
    #banner { height: 1; background: $error; color: $text; padding: 0 1; display: none; }
    #banner.-visible { display: block; }
    #body { grid-size: 2 2; grid-columns: 2fr 1fr; grid-rows: 1fr 1fr; }
    #body > * { border: round $primary-darken-1; border-title-color: $text; border-title-style: bold; }
    #body.-stale > * { border: round $panel-lighten-2; }
    #body.-stale Static, #body.-stale DataTable { text-opacity: 45%; }
    #body.-stale Sparkline > .sparkline--max-color,
    #body.-stale Sparkline > .sparkline--min-color { color: $panel-lighten-2; }
    #batch-summary { height: 2; }
    #requests { scrollbar-size-vertical: 1; }
    #batch-legend { height: 2; }
    #seqs-sparkline, #out-sparkline, #prefill-sparkline, #req-sparkline { height: 2; margin-bottom: 1; }
    #kv-summary, #kv-legend { height: 1; }
    #latency { height: 5; }
    #extras { height: auto; max-height: 14; }
    #extras > * { height: auto; width: 1fr; border: round $primary-darken-1; border-title-style: bold; }
    """
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("p", "pause", "pause"),
        Binding("question_mark", "help", "help", key_display="?"),
        Binding("s", "sort_next", "sort"),
        Binding("r", "sort_reverse", "reverse"),
        Binding("escape", "clear_selection", "clear selection", show=False),
    ]

    def __init__(self, source: StatsSource, interval: float | None = 0.25) -> None:
        """``interval`` seconds between polls; ``None`` polls only when ``poll_once`` is called
        (tests drive the app that way)."""
        super().__init__()
        self.source = source
        self.interval = interval
        self.state = DashboardState()
        self.paused = False
        self.selected_id: str | None = None
        self._polling = False

    def compose(self) -> ComposeResult:
        yield Line(id="status")
        yield Line(id="banner")
        with Grid(id="body"):
            yield KvPanel(id="kv")
            yield BatchPanel(id="batch")
            yield RequestsTable(id="requests")
            yield ThroughputPanel(id="throughput")
        with Horizontal(id="extras"):
            yield ExpertPanel(id="experts")
            yield ModelsPanel(id="models")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#requests").border_title = "Requests"
        for extra in (ExpertPanel, ModelsPanel):  # shown once a snapshot has what they draw
            self.query_one(extra).display = False
        self.redraw()
        if self.interval is not None:
            self.call_later(self.poll_once)
            self.set_interval(self.interval, self.poll_once)

    async def on_unmount(self) -> None:
        await self.source.close()

    # ---- polling -------------------------------------------------------------------------------
    async def poll_once(self) -> None:
        """Fetch one snapshot and redraw; any failure of the source marks the dashboard
        disconnected (the next poll is the retry)."""
        if self.paused or self._polling:
            return
        self._polling = True
        try:
            snapshot = await self.source.fetch()
            if snapshot is not None:
                self.state.ingest(snapshot)
        except Exception as exc:  # noqa: BLE001 - whatever went wrong, keep the last data and retry
            # a SourceError already says what went wrong; anything else is named by its type
            message = str(exc) if isinstance(exc, SourceError) else f"{type(exc).__name__}: {exc}"
            self.state.mark_failure(message or type(exc).__name__, getattr(exc, "kind", "disconnected"))
        finally:
            self._polling = False
        try:
            self.redraw()
        except NoMatches:  # the app closed while the fetch was in flight: nothing left to draw on
            pass

    # ---- drawing -------------------------------------------------------------------------------
    @property
    def selected_request(self) -> dict[str, Any] | None:
        snap = self.state.snapshot
        if snap is None or self.selected_id is None:
            return None
        return next((r for r in snap["requests"] if r["id"] == self.selected_id), None)

    def redraw(self) -> None:
        state = self.state
        if state.snapshot is not None and self.selected_id is not None and self.selected_request is None:
            self._select(None)  # the selected request finished
        self._draw_status()
        self.query_one("#body").set_class(not state.connected and state.snapshot is not None, "-stale")
        if state.snapshot is None:
            return
        self.query_one(KvPanel).show(state, self.selected_request)
        self.query_one(BatchPanel).show(state)
        table = self.query_one(RequestsTable)
        table.show(state.snapshot["requests"])
        table.border_title = f"Requests ({len(state.snapshot['requests'])})"
        self.query_one(ThroughputPanel).show(state)
        self.query_one(ExpertPanel).show(state.snapshot)
        self.query_one(ModelsPanel).show(state.snapshot)
        self.query_one("#extras").display = self.query_one(ExpertPanel).display or self.query_one(ModelsPanel).display

    def _draw_status(self) -> None:
        """The connection state first, so a narrow terminal cuts the model name, never the state."""
        state, snap = self.state, self.state.snapshot
        if self.paused:
            status = Text("⏸ PAUSED (p resumes)", "bold yellow")
        elif state.connected:
            status = Text("● live", "bold green")
        elif state.error is not None:
            status = Text("⚠ " + state.error_kind, "bold red")
        else:
            status = Text("… connecting", "yellow")
        status.append_text(Text.assemble("  ", ("llmctl top", "bold"), " · ", self.source.label))
        if snap is not None:
            status.append(f" · {snap['model']} · step {snap['step']:,} · up {_duration(snap['uptime_s'])}")
            if snap.get("note"):  # e.g. drawn from a vLLM server's /metrics: what is missing
                status.append(f" · {snap['note']}", "dim")
            server = snap.get("server")  # what `llmctl serve` adds to the engine's snapshot
            if server:
                status.append(f" · {server.get('in_flight', 0)} in flight")
                if server.get("rejected_queue_full"):
                    status.append(f" · {server['rejected_queue_full']} rejected (queue full)", "red1")
                if server.get("draining"):
                    status.append(" · draining", "bold yellow")
        self.query_one("#status", Line).show(status)
        banner = self.query_one("#banner", Line)
        banner.set_class(state.error is not None, "-visible")
        if state.error is not None:
            since = state.seconds_since_update
            shown = f" · showing data from {since:.0f} s ago" if since is not None else " · no data yet"
            if state.error_kind == "disconnected":
                banner.show(f"⚠ disconnected — retrying ({state.error}){shown}")
            else:  # the server answers, but not with what top can draw: say what, not "disconnected"
                banner.show(f"⚠ {state.error}")

    # ---- actions -------------------------------------------------------------------------------
    def action_pause(self) -> None:
        self.paused = not self.paused
        self._draw_status()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_sort_next(self) -> None:
        table = self.query_one(RequestsTable)
        table.sort_by(table.next_sort_column())

    def action_sort_reverse(self) -> None:
        table = self.query_one(RequestsTable)
        table.sort_by(table.sort_column, reverse=not table.sort_reverse)

    def action_clear_selection(self) -> None:
        self._select(None)
        self.redraw()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        request_id = event.row_key.value
        self._select(None if request_id == self.selected_id else request_id)
        self.redraw()

    def _select(self, request_id: str | None) -> None:
        self.selected_id = request_id
        self.query_one(RequestsTable).select(request_id)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
