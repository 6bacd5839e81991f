"""The dashboard's panels. Each takes the ``DashboardState`` in ``show()`` and draws it; none of
them fetches anything or keeps history of its own."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from llmctl.tui.blockmap import CACHED, FREE, GLYPHS, HIGHLIGHT_BG, SHARED, STATE_COLORS, USED, BlockMap
from llmctl.tui.state import DashboardState
from llmctl.tui.stepbars import DECODE_COLOR, PREFILL_COLOR, StepBars


class Line(Static):
    """Text of a fixed height (set in CSS): updated without a layout pass, which would otherwise be
    the costliest part of a refresh, and only when the text changed."""

    def show(self, text: Text | str) -> None:
        if text != getattr(self, "_shown", None):
            self._shown = text
            self.update(text, layout=False)


def format_seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def format_rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


class KvPanel(Vertical):
    """Block map, pool counts, prefix-cache hit rate, and the selected request's share of the pool."""

    def compose(self) -> ComposeResult:
        yield Line(id="kv-summary")
        yield BlockMap(id="block-map")
        yield Line(id="kv-legend")

    def show(self, state: DashboardState, selected: dict[str, Any] | None) -> None:
        snap = state.snapshot
        if snap is None:
            return
        kv, prefix = snap["kv"], snap["prefix_cache"]
        self.border_title = f"KV cache · {kv['num_blocks']:,} blocks × {snap['config']['block_size']} tokens"
        if "kv_cache_dtype" in snap["config"]:  # absent from a vLLM server's metrics
            config = snap["config"]
            self.border_title += f" · {config['kv_cache_dtype']}, {config['kv_bytes_per_token']:g} B/token"
        summary = Text.assemble(
            ("usage ", "bold"),
            f"{100 * kv['usage']:.1f}%  ",
            (f"{kv['used']:,} used", STATE_COLORS[USED]),
            " · ",
            (f"{kv['shared']:,} shared", STATE_COLORS[SHARED]),
            " · ",
            (f"{kv['cached']:,} cached", STATE_COLORS[CACHED]),
            " · ",
            (f"{kv['free']:,} free", STATE_COLORS[FREE]),
            "   ",
            ("prefix hit ", "bold"),
            f"{100 * prefix['hit_rate']:.1f}% ",
            (f"({prefix['hits']:,}/{prefix['queries']:,} tokens)", "dim"),
        )
        block_map = self.query_one(BlockMap)
        block_map.update_map(kv["block_states"], selected["blocks"] if selected else (), stale=not state.connected)
        self.query_one("#kv-summary", Line).show(summary)
        legend = Text.assemble(
            (GLYPHS[USED], STATE_COLORS[USED]),
            " used  ",
            (GLYPHS[SHARED], STATE_COLORS[SHARED]),
            " shared  ",
            (GLYPHS[CACHED], STATE_COLORS[CACHED]),
            " cached  ",
            (GLYPHS[FREE], STATE_COLORS[FREE]),
            " free  ",
            (" ■ ", f"black on {HIGHLIGHT_BG}"),
            " selected",
        )
        if selected:
            legend.append(f": {selected['id']} holds {len(selected['blocks'])} blocks")
        if block_map.group_size > 1:
            legend.append(f"   1 cell = {block_map.group_size} blocks", "dim")
        self.query_one("#kv-legend", Line).show(legend)


class BatchPanel(Vertical):
    """What the last steps were made of: prefill vs decode tokens, sequences per step, queue sizes."""

    def compose(self) -> ComposeResult:
        yield Line(id="batch-summary")
        yield StepBars(id="step-bars")
        yield Line(id="batch-legend")
        yield Sparkline(id="seqs-sparkline")

    def show(self, state: DashboardState) -> None:
        snap = state.snapshot
        if snap is None:
            return
        self.border_title = "Batch composition"
        sched, counters = snap["scheduler"], snap["counters"]
        summary = Text.assemble(
            ("running ", "bold"),
            (f"{sched['running']}", "green3"),
            " · ",
            ("waiting ", "bold"),
            (f"{max(0, sched['waiting'] - sched['preempted_waiting'])}", "yellow3"),
            " · ",
            ("preempted ", "bold"),
            (f"{sched['preempted_waiting']}", "red1"),
            (f" ({counters['num_preemptions']:,} in all)", "dim"),
        )
        summary.append_text(spec_decode_text(snap.get("spec_decode")))
        steps = list(state.steps)
        if steps:
            last = steps[-1]
            summary.append(f"\nstep {last['step']:,}: ")
            summary.append(f"prefill {last['prefill_tokens']}", PREFILL_COLOR)
            summary.append(" · ")
            summary.append(f"decode {last['decode_tokens']}", DECODE_COLOR)
            summary.append(f" · {last['num_seqs']} seqs · {format_seconds(last['duration_s'])}")
        else:
            summary.append("\nno step yet")
        self.query_one("#batch-summary", Line).show(summary)
        bars = self.query_one(StepBars)
        bars.update_steps(steps, stale=not state.connected)
        self.query_one("#batch-legend", Line).show(
            Text.assemble(
                ("█", PREFILL_COLOR),
                " prefill  ",
                ("█", DECODE_COLOR),
                " decode tokens per step",
                (f"  (top = {max((s['prefill_tokens'] + s['decode_tokens'] for s in steps), default=0):,})", "dim"),
                "\nsequences per step",
                (f"  (max {max((s['num_seqs'] for s in steps), default=0)})", "dim"),
            )
        )
        self.query_one("#seqs-sparkline", Sparkline).data = [s["num_seqs"] for s in steps] or [0]


class ThroughputPanel(Vertical):
    """Rates from counter deltas between snapshots, and recent latency percentiles."""

    def compose(self) -> ComposeResult:
        yield Line(id="out-rate")
        yield Sparkline(id="out-sparkline")
        yield Line(id="prefill-rate")
        yield Sparkline(id="prefill-sparkline")
        yield Line(id="req-rate")
        yield Sparkline(id="req-sparkline")
        yield Line(id="latency")

    def show(self, state: DashboardState) -> None:
        snap = state.snapshot
        if snap is None:
            return
        self.border_title = "Throughput & latency"
        for name, label, series in (
            ("out", "output tokens/s", state.output_tokens_per_s),
            ("prefill", "prefill tokens/s", state.prefill_tokens_per_s),
            ("req", "finished requests/s", state.finished_requests_per_s),
        ):
            now = format_rate(series[-1]) if series else "n/a"
            peak = f"  (peak {format_rate(max(series))})" if series else ""
            self.query_one(f"#{name}-rate", Line).show(Text.assemble((label + " ", "bold"), now, (peak, "dim")))
            self.query_one(f"#{name}-sparkline", Sparkline).data = list(series) or [0]
        self.query_one("#latency", Line).show(latency_text(snap.get("latency")))


def spec_decode_text(spec: dict[str, Any] | None) -> Text:
    """Speculative decoding's acceptance, for the batch summary (empty without speculation)."""
    if not spec:
        return Text()
    rate, length = spec.get("acceptance_rate"), spec.get("mean_accepted_length")
    text = Text.assemble(" · ", ("spec ", "bold"), f"{spec.get('method', '?')} ")
    if rate is None:
        return text.append("no drafts yet", "dim")
    text.append(f"{100 * rate:.1f}% accepted")
    if length is not None:
        text.append(f", {length:.2f} tok/verify", "dim")
    return text


def latency_text(latency: dict[str, Any] | None) -> Text:
    if not latency:
        return Text.assemble(
            ("TTFT n/a · TPOT n/a", "bold"), ("\n(the server's snapshot has no latency section)", "dim")
        )
    text = Text.assemble(("        p50       p90       p99", "bold"))
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E ")):
        values = latency.get(key) or {}
        text.append(f"\n{label}" + "".join(f"{format_seconds(values.get(p)):>10}" for p in ("p50", "p90", "p99")))
    text.append(f"\nlast {latency.get('count', 0)} finished requests (window {latency.get('window', '?')})", "dim")
    return text
