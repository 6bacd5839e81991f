"""The dashboard's parts without a screen: grouping, bars, rates, latency, sources, the load mix."""

from __future__ import annotations

import asyncio
import copy
import json

import httpx
import pytest

from llmctl.engine.latency import LatencyWindow, percentiles
from llmctl.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmctl.tui.blockmap import group_states, highlighted_cells, layout
from llmctl.tui.load import SYSTEM_PROMPTS, LoadProfile, RequestMix
from llmctl.tui.sources import HttpSource, ReplaySource, SourceError
from llmctl.tui.state import DashboardState
from llmctl.tui.stepbars import bar_cell
from llmctl.tui.synthetic import synthetic_snapshot


def test_groups_show_their_busiest_block():
    assert group_states("..c.uu.s", 1) == "..c.uu.s"
    assert group_states("..c.uu.s", 2) == ".cus"
    assert group_states("....cccc.u", 4) == ".cu"  # the last group is short
    assert group_states("sc..", 4) == "s"
    assert highlighted_cells([0, 5, 6, 13], 4) == {0, 1, 3}


def test_layout_fits_the_whole_pool():
    assert layout(320, 104, 19) == (2, 2, 1)  # room for a spaced grid
    assert layout(1000, 104, 19) == (1, 1, 1)  # one column per block
    for blocks, width, height in ((4096, 104, 19), (4096, 40, 5), (100_000, 100, 10)):
        cell_width, pitch, group = layout(blocks, width, height)
        assert cell_width == 1 and -(-blocks // group) <= width * height
        assert -(-blocks // (group - 1)) > width * height if group > 1 else True  # the smallest group that fits


def test_bar_cells_stack_prefill_under_decode():
    # prefill 12 eighths, total 20 eighths, bar 3 rows high
    assert bar_cell(12, 20, 0) == ("█", "p", None)
    assert bar_cell(12, 20, 1) == ("▄", "p", "d")  # prefill ends half way, decode above it
    assert bar_cell(12, 20, 2) == ("▄", "d", None)  # decode tops out half way
    assert bar_cell(0, 3, 0) == ("▃", "d", None)
    assert bar_cell(0, 0, 0) == (" ", None, None)


def test_rates_restart_and_step_merge():
    state = DashboardState()
    snaps = [synthetic_snapshot(64, 8, tick=t, steps_kept=20) for t in range(3)]
    state.ingest(snaps[0])
    assert state.rates is None and [s["step"] for s in state.steps] == list(range(1, 21))
    state.ingest(snaps[1])
    assert state.rates.output_tokens_per_s == pytest.approx(60 / 0.25)
    assert [s["step"] for s in state.steps] == list(range(1, 31))  # steps 11..30 merged once
    restarted = copy.deepcopy(snaps[0])
    restarted["uptime_s"] = 1.0
    restarted["time"] = snaps[1]["time"] + 1
    state.ingest(restarted)
    assert state.restarts == 1 and state.rates is None and not state.output_tokens_per_s
    assert [s["step"] for s in state.steps] == list(range(1, 21))
    state.mark_failure("boom")
    assert not state.connected and state.failures == 1 and state.snapshot is restarted


def _finished(arrival, first, last, tokens, reason="length"):
    metrics = RequestMetrics(arrival, first_token_time=first, last_token_time=last, finished_time=last)
    return RequestOutput("r", None, [1], [CompletionOutput(0, "", list(range(tokens)), reason)], True, 0, metrics)


def test_latency_window_percentiles():
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    # the one percentile function (linear interpolation, numpy's default) that bench uses too
    assert percentiles(list(range(1, 101))) == pytest.approx({"p50": 50.5, "p90": 90.1, "p99": 99.01})
    window = LatencyWindow(window=3)
    window.observe(_finished(0.0, 0.5, 2.5, 5))  # ttft 0.5, tpot 0.5
    window.observe(_finished(0.0, 0.2, 0.2, 1))  # one token: no tpot
    window.observe(_finished(0.0, 0.1, 0.1, 3, reason="abort"))  # aborted: ignored
    section = window.section()
    assert section["count"] == 2 and section["window"] == 3
    assert section["ttft_s"]["p50"] == pytest.approx(0.35) and section["ttft_s"]["p99"] == pytest.approx(0.497)
    assert section["tpot_s"] == {"p50": 0.5, "p90": 0.5, "p99": 0.5}
    for _ in range(5):
        window.observe(_finished(0.0, 1.0, 2.0, 2))
    assert window.section()["count"] == 3 and window.section()["ttft_s"]["p50"] == 1.0


def test_request_mix_covers_every_case():
    mix = RequestMix(LoadProfile(seed=3))
    specs = [mix.next_request() for _ in range(400)]
    kinds = {s.kind for s in specs}
    assert kinds == {"chat", "document", "short"}
    chats = [s for s in specs if s.kind == "chat"]
    for prompt in SYSTEM_PROMPTS.values():
        assert sum(s.prompt.startswith(prompt) for s in chats) > 5  # shared prefixes recur
    assert any(s.params.n > 1 for s in specs) and any(s.hang_up_after for s in specs)
    assert len({s.user for s in specs}) == len(LoadProfile().users)
    again = RequestMix(LoadProfile(seed=3))
    assert [again.next_request().prompt for _ in range(20)] == [s.prompt for s in specs[:20]]  # seeded


def test_http_source_reads_and_reports_failures():
    snapshot = synthetic_snapshot(16, 2)
    status = {"models": [{"name": "a"}], "memory_used_bytes": 1}
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["auth"] = request.headers.get("authorization")
        if request.url.path == "/v1/models/status":
            return httpx.Response(200, json=status) if seen.get("mode", "ok") == "ok" else httpx.Response(404)
        seen["path"] = request.url.path
        mode = seen.get("mode", "ok")
        if mode == "ok":
            return httpx.Response(200, json=snapshot)
        if mode == "500":
            return httpx.Response(500, text="oops")
        if mode == "html":
            return httpx.Response(200, text="<html>")
        raise httpx.ConnectError("Connection refused")

    async def main():
        source = HttpSource("http://engine:8000/", api_key="k3y", transport=httpx.MockTransport(handler))
        assert await source.fetch() == {**snapshot, "models_status": status}
        assert seen["auth"] == "Bearer k3y" and seen["path"] == "/v1/engine/stats"
        for mode, message in (("500", "HTTP 500"), ("html", "did not answer JSON"), ("down", "Connection refused")):
            seen["mode"] = mode
            with pytest.raises(SourceError, match=message):
                await source.fetch()
        await source.close()

    asyncio.run(main())


def test_replay_source(tmp_path):
    path = tmp_path / "snaps.jsonl"
    path.write_text("\n".join(json.dumps({"n": i}) for i in range(3)) + "\n")

    async def main():
        once = ReplaySource.from_jsonl(path)
        assert [await once.fetch() for _ in range(4)] == [{"n": 0}, {"n": 1}, {"n": 2}, None]
        looped = ReplaySource.from_jsonl(path, loop=True)
        assert [(await looped.fetch())["n"] for _ in range(5)] == [0, 1, 2, 0, 1]

    asyncio.run(main())
    with pytest.raises(ValueError):
        ReplaySource([])
