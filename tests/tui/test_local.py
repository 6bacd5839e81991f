"""``llmctl top --local`` through the real command line, run headless for a few seconds: the
in-process engine under the synthetic load must show activity on every panel."""

from __future__ import annotations

import time

from tui_helpers import drive, shown_text
from typer.testing import CliRunner

import llmctl.tui.cli as tui_cli
from llmctl.cli import app as cli_app
from llmctl.tui.blockmap import BlockMap
from llmctl.tui.requests_table import RequestsTable


def test_top_local_shows_a_live_engine(monkeypatch):
    seen = {}

    def run_headless(app) -> None:
        async def scenario(app, pilot):
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                await pilot.pause(0.3)
                state = app.state
                if (
                    state.snapshot
                    and state.snapshot["requests"]
                    and any(state.output_tokens_per_s)
                    and state.snapshot["latency"]["count"] > 0
                ):
                    break
            await pilot.pause()
            seen["snapshot"] = app.state.snapshot
            seen["rates"] = list(app.state.output_tokens_per_s)
            seen["rows"] = app.query_one(RequestsTable).row_count
            seen["cells"] = app.query_one(BlockMap).cells
            seen["status"] = shown_text(app.query_one("#status"))
            seen["latency"] = shown_text(app.query_one("#latency"))
            await pilot.press("q")

        drive(app, scenario)
        seen["closed"] = app.source.async_engine is None

    monkeypatch.setattr(tui_cli, "run_app", run_headless)
    result = CliRunner().invoke(
        cli_app,
        [
            "top",
            "--local",
            "--kv-cache-memory",
            "8MiB",
            "--max-num-seqs",
            "8",
            "--rate",
            "20",
            "--threads",
            "1",
            "--interval",
            "0.2",
        ],
    )
    assert result.exit_code == 0, result.output
    snap = seen["snapshot"]
    assert "RANDOM weights" in snap["model"] and "local engine" in seen["status"] and "● live" in seen["status"]
    assert snap["counters"]["generation_tokens_total"] > 0 and max(seen["rates"]) > 0
    assert seen["rows"] == len(snap["requests"]) > 0
    assert set(seen["cells"]) & {"u", "s"}  # blocks in use
    assert snap["latency"]["count"] > 0 and "TTFT" in seen["latency"] and "n/a" not in seen["latency"]
    assert seen["closed"]  # quitting stopped the engine and the load


def test_top_rejects_local_with_replay(tmp_path):
    replay = tmp_path / "s.jsonl"
    replay.write_text("{}\n")
    result = CliRunner().invoke(cli_app, ["top", "--local", "--replay", str(replay)])
    assert result.exit_code != 0 and "--local" in result.output


def test_top_local_bad_engine_option_is_one_red_line():
    result = CliRunner().invoke(cli_app, ["top", "--local", "--kv-cache-memory", "1KiB"])
    assert result.exit_code == 1
    assert "error:" in result.output and "Traceback" not in result.output
