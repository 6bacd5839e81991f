"""Presenting a run: the rich table (side by side with a baseline), the verdict against the service
goals, and the same figures as JSON for scripts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from llmctl.bench.metrics import Distribution, Slo, Summary
from llmctl.bench.runner import EngineRunStats

REPORT_VERSION = 1
GOAL_TTFT_P99_MS = 500.0  # the service goals: P99 TTFT under 500 ms ...
GOAL_STREAM_TOKENS_PER_S = 30.0  # ... and at least 30 tokens/s per stream
STATS = ("mean", "median", "p90", "p99")


@dataclass
class BenchReport:
    """One side of the comparison: a target's summary and, in process, the engine's view."""

    label: str
    summary: Summary
    engine: EngineRunStats | None = None


@dataclass
class Verdict:
    name: str
    value: float | None
    goal: float
    higher_is_better: bool
    unit: str

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.goal if self.higher_is_better else self.value < self.goal

    def line(self) -> str:
        mark = "[green]✓[/]" if self.met else "[red]✗[/]"
        if self.value is None:
            return f"{self.name} not measured {mark}"
        sign = "≥" if self.higher_is_better else "<"
        if not self.met:
            sign = "<" if self.higher_is_better else "≥"
        return f"{self.name} {self.value:.1f} {self.unit} {sign} {self.goal:g} {self.unit} {mark}"


def verdicts(summary: Summary) -> list[Verdict]:
    return [
        Verdict("P99 TTFT", summary.ttft_ms.p99, GOAL_TTFT_P99_MS, False, "ms"),
        Verdict(
            "per-stream decode speed = 1 / P99 TPOT =",
            summary.stream_tokens_per_s_p99,
            GOAL_STREAM_TOKENS_PER_S,
            True,
            "tok/s",
        ),
    ]


# ---- the table -----------------------------------------------------------------------------------
@dataclass
class _Row:
    label: str
    values: list[float | None]  # one per side
    fmt: str = "{:.2f}"
    higher_is_better: bool | None = None  # None: no ratio (counts, engine internals)


def _rows(sides: list[BenchReport]) -> list[_Row | None]:
    """The table's rows, ``None`` drawing a section break."""
    s = [side.summary for side in sides]
    rows: list[_Row | None] = [
        _Row("Successful requests", [x.completed for x in s], "{:.0f}"),
        _Row("Failed requests", [x.failed for x in s], "{:.0f}"),
        _Row("Duration (s)", [x.duration_s for x in s], "{:.2f}", False),
        _Row("Input tokens", [x.input_tokens for x in s], "{:.0f}"),
        _Row("Output tokens", [x.output_tokens for x in s], "{:.0f}"),
        None,
        _Row("Request throughput (req/s)", [x.request_throughput for x in s], "{:.2f}", True),
        _Row("Output throughput (tok/s)", [x.output_throughput for x in s], "{:.1f}", True),
        _Row("Total throughput (tok/s)", [x.total_token_throughput for x in s], "{:.1f}", True),
    ]
    for title, attr in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        rows.append(None)
        for stat in STATS:
            name = stat.upper() if stat.startswith("p") else stat
            rows.append(_Row(f"{title} {name} (ms)", [getattr(getattr(x, attr), stat) for x in s], "{:.1f}", False))
    rows.append(None)
    rows.append(_Row("Goodput (req/s)", [x.goodput for x in s], "{:.2f}", True))
    rows.append(_Row("Requests meeting the SLOs", [x.good_requests for x in s], "{:.0f}"))
    if any(side.engine is not None for side in sides):
        rows.append(None)
        engine = [side.engine for side in sides]
        rows.append(_Row("KV cache usage mean (%)", [100 * e.kv_usage_mean if e else None for e in engine], "{:.1f}"))
        rows.append(_Row("KV cache usage peak (%)", [100 * e.kv_usage_peak if e else None for e in engine], "{:.1f}"))
        rows.append(
            _Row(
                "KV slot utilization (%)",
                [
                    100 * e.token_slot_utilization if e and e.token_slot_utilization is not None else None
                    for e in engine
                ],
                "{:.1f}",
            )
        )
        rows.append(
            _Row(
                "Prefix cache hit rate (%)",
                [100 * e.prefix_hit_rate if e and e.prefix_hit_rate is not None else None for e in engine],
                "{:.1f}",
            )
        )
        rows.append(_Row("Preemptions", [e.num_preemptions if e else None for e in engine], "{:.0f}"))
        if any(e and e.spec_num_drafts for e in engine):
            rows.append(
                _Row(
                    "Spec. decode acceptance (%)",
                    [
                        100 * e.spec_acceptance_rate if e and e.spec_acceptance_rate is not None else None
                        for e in engine
                    ],
                    "{:.1f}",
                )
            )
            rows.append(
                _Row(
                    "Spec. decode tokens per verify",
                    [e.spec_mean_accepted_length if e else None for e in engine],
                    "{:.2f}",
                )
            )
    return rows


def advantage(ours: float | None, theirs: float | None, higher_is_better: bool) -> float | None:
    """How many times better ours is: ours / theirs for throughputs, theirs / ours for latencies."""
    if ours is None or theirs is None or ours <= 0 or theirs <= 0:
        return None
    return ours / theirs if higher_is_better else theirs / ours


def build_table(sides: list[BenchReport]) -> Table:
    table = Table(show_lines=False)
    table.add_column("Metric")
    for side in sides:
        table.add_column(side.label, justify="right")
    if len(sides) == 2:
        table.add_column("advantage", justify="right")
    for row in _rows(sides):
        if row is None:
            table.add_section()
            continue
        cells = ["—" if v is None else row.fmt.format(v) for v in row.values]
        if len(sides) == 2:
            ratio = (
                advantage(row.values[0], row.values[1], row.higher_is_better)
                if row.higher_is_better is not None
                else None
            )
            cells.append("" if ratio is None else f"{ratio:.2f}×")
        table.add_row(row.label, *cells)
    return table


def slo_text(slo: Slo) -> str:
    parts = [
        f"{name} ≤ {round(value, 1):g} ms"
        for name, value in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms))
        if value is not None
    ]
    return ", ".join(parts) or "none (every successful request counts)"


def print_report(console: Console, sides: list[BenchReport], title: str, notes: list[str] = ()) -> None:
    console.print(f"[bold]{title}[/]")
    console.print(build_table(sides))
    console.print(f"[dim]goodput SLOs: {slo_text(sides[0].summary.slo)}[/]")
    if len(sides) == 2:
        console.print(
            f"[dim]advantage: {sides[0].label} ÷ {sides[1].label} for throughputs, the inverse for "
            f"latencies; above 1× {sides[0].label} is better[/]"
        )
    for note in notes:
        console.print(f"[dim]{note}[/]")
    main = sides[0].summary
    if main.errors:
        console.print(f"[red]{main.failed} request(s) failed[/], e.g.: " + " | ".join(main.errors))
    console.print(f"[bold]Service goals[/] ({sides[0].label}):")
    for verdict in verdicts(main):
        console.print(f"  {verdict.line()}")
    if len(sides) == 2:
        ours, theirs = sides[0].summary, sides[1].summary
        ratio = advantage(ours.output_throughput, theirs.output_throughput, True)
        if ratio is not None:
            console.print(f"  output throughput vs {sides[1].label}: {ratio:.2f}×")


# ---- JSON ----------------------------------------------------------------------------------------
def _distribution(d: Distribution) -> dict[str, Any]:
    return asdict(d)


def side_to_dict(side: BenchReport) -> dict[str, Any]:
    s = side.summary
    out: dict[str, Any] = {
        "label": side.label,
        "duration_s": s.duration_s,
        "num_requests": s.num_requests,
        "completed": s.completed,
        "failed": s.failed,
        "input_tokens": s.input_tokens,
        "output_tokens": s.output_tokens,
        "request_throughput": s.request_throughput,
        "output_throughput": s.output_throughput,
        "total_token_throughput": s.total_token_throughput,
        "ttft_ms": _distribution(s.ttft_ms),
        "tpot_ms": _distribution(s.tpot_ms),
        "itl_ms": _distribution(s.itl_ms),
        "e2e_ms": _distribution(s.e2e_ms),
        "slo": asdict(s.slo),
        "good_requests": s.good_requests,
        "goodput": s.goodput,
        "stream_tokens_per_s_p99": s.stream_tokens_per_s_p99,
        "stream_tokens_per_s_median": s.stream_tokens_per_s_median,
        "errors": s.errors,
    }
    if side.engine is not None:
        engine = asdict(side.engine)
        engine["prefix_hit_rate"] = side.engine.prefix_hit_rate
        engine["spec_acceptance_rate"] = side.engine.spec_acceptance_rate
        engine["spec_mean_accepted_length"] = side.engine.spec_mean_accepted_length
        out["engine"] = engine
    return out


def report_dict(sides: list[BenchReport], config: dict[str, Any]) -> dict[str, Any]:
    main = sides[0].summary
    data: dict[str, Any] = {
        "version": REPORT_VERSION,
        "config": config,
        "result": side_to_dict(sides[0]),
        "goals": {
            "ttft_p99_ms": {"value": main.ttft_ms.p99, "goal": GOAL_TTFT_P99_MS, "met": verdicts(main)[0].met},
            "stream_tokens_per_s": {
                "value": main.stream_tokens_per_s_p99,
                "goal": GOAL_STREAM_TOKENS_PER_S,
                "met": verdicts(main)[1].met,
            },
        },
        "baseline": None,
        "advantage": None,
    }
    if len(sides) == 2:
        ours, theirs = sides[0].summary, sides[1].summary
        data["baseline"] = side_to_dict(sides[1])
        data["advantage"] = {
            "request_throughput": advantage(ours.request_throughput, theirs.request_throughput, True),
            "output_throughput": advantage(ours.output_throughput, theirs.output_throughput, True),
            "total_token_throughput": advantage(ours.total_token_throughput, theirs.total_token_throughput, True),
            **{
                f"{name}_{stat}": advantage(
                    getattr(getattr(ours, name), stat), getattr(getattr(theirs, name), stat), False
                )
                for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
                for stat in STATS
            },
        }
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
