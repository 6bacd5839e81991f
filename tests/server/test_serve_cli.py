"""The ``llmctl serve`` command itself: its flags, and SIGTERM draining in-flight requests."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import httpx
from server_helpers import wait_until
from typer.testing import CliRunner

from llmctl.cli import app


def test_flags_are_named_as_in_vllm():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == 0
    text = re.sub(r"\x1b\[[0-9;]*m", "", result.output)
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--max-queue",
        "--served-model-name",
        "--drain-timeout",
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--block-size",
        "--dtype",
        "--enable-prefix-caching",
        "--no-prefix-caching",
    ):
        assert flag in text, flag
    assert "LLMCTL_API_KEY" in text


def test_a_missing_model_is_one_clear_line():
    result = CliRunner().invoke(app, ["serve", "/nonexistent/model-dir"])
    assert result.exit_code == 1
    assert "error:" in result.output and "/nonexistent/model-dir" in result.output
    assert "Traceback" not in result.output


def test_sigterm_drains_in_flight_requests_then_exits_0(start_server, stories_dir):
    server = start_server(str(stories_dir), "--kv-cache-memory", "16MiB", "--drain-timeout", "60")
    events_before: list[dict] = []
    events_after: list[dict] = []
    signalled = threading.Event()
    stats_streaming = threading.Event()
    stats_ended = threading.Event()
    first_tokens = threading.Event()

    def stream_completion() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    (events_after if signalled.is_set() else events_before).append(json.loads(line[6:]))
                    if len(events_before) == 3:
                        first_tokens.set()
                elif line == "data: [DONE]":
                    events_after.append({"done": True})

    def watch_stats() -> None:  # an endless stream of stats must not hold up the drain
        with httpx.stream(
            "GET", f"{server.base_url}/engine/stats/stream", params={"interval": 0.1}, timeout=60
        ) as response:
            for _ in response.iter_lines():
                stats_streaming.set()
        stats_ended.set()

    # the stats stream opens first: one that connected after the signal would be refused, and the
    # completion, once started, must be signalled within its first few tokens
    threads = [threading.Thread(target=watch_stats), threading.Thread(target=stream_completion)]
    threads[0].start()
    assert stats_streaming.wait(timeout=60)
    threads[1].start()
    assert first_tokens.wait(timeout=60)
    signalled.set()
    server.proc.send_signal(signal.SIGTERM)
    # the listening socket closes at once: new connections are refused while the stream goes on
    wait_until(lambda: _refused(server.url), timeout=10)
    exit_code = server.proc.wait(timeout=60)
    for thread in threads:
        thread.join(timeout=10)
    assert exit_code == 0, server.log()
    assert stats_ended.is_set()
    assert len(events_after) > 50  # the request really was in flight when the signal came
    assert events_after[-1] == {"done": True}
    texts = [e["choices"][0] for e in events_before + events_after[:-1]]
    assert texts[-1]["finish_reason"] == "length" and sum(t["finish_reason"] is not None for t in texts) == 1
    assert "timeout graceful shutdown exceeded" not in server.log()


def _refused(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


class _EveryStream:
    """Waits until every stream has generated a few events: both must be running when the test
    interrupts the server (one Event for both let a loaded machine interrupt it before the second
    stream was admitted, which then got a 503 instead of a stream)."""

    def __init__(self, count: int) -> None:
        self.events = [threading.Event() for _ in range(count)]

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(event.wait(max(0.0, deadline - time.monotonic())) for event in self.events)


def _start_cancellable_load(server) -> tuple[list[threading.Thread], dict[str, object], _EveryStream]:
    """Two streams that are generating and one plain request, all far from done."""
    results: dict[str, object] = {}
    streaming = _EveryStream(2)
    body = {"prompt": "Hello there", "max_tokens": 2000, "ignore_eos": True, "temperature": 0}

    def stream(index: int) -> None:
        events: list = []
        with httpx.stream(
            "POST", f"{server.base_url}/completions", json={**body, "stream": True}, timeout=120
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
                    if len(events) >= 3:
                        streaming.events[index].set()
        results[f"stream{index}"] = events

    def plain() -> None:
        results["plain"] = httpx.post(f"{server.base_url}/completions", json=body, timeout=120)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    threads.append(threading.Thread(target=plain))
    for thread in threads:
        thread.start()
    return threads, results, streaming


def _wait_for_load(server, streaming: _EveryStream) -> None:
    """Both streams generating and all three requests inside the engine: on a busy machine the
    plain request can still be on its way when the streams are, and one that arrives after the
    signal is refused (503) rather than cancelled."""
    assert streaming.wait(timeout=120)
    wait_until(lambda: len(httpx.get(f"{server.url}/v1/engine/stats").json()["requests"]) == 3, timeout=60)


def _check_cancelled(results: dict[str, object], log: str) -> None:
    for name in ("stream0", "stream1"):
        events = results[name]
        assert events[-1] == "[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["code"] == "shutting_down" and "shut down before this request finished" in error["message"]
    plain = results["plain"]
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "shutting_down"
    assert "cancelled 3 requests still running" in log
    assert "Traceback" not in log and "CancelledError" not in log and "Exception in ASGI" not in log


def test_drain_timeout_cancels_with_error_events_and_exits_3(start_server):
    server = start_server("tiny-random-llama", "--kv-cache-memory", "64MiB", "--drain-timeout", "1")
    threads, results, streaming = _start_cancellable_load(server)
    _wait_for_load(server, streaming)
    server.proc.send_signal(signal.SIGTERM)
    exit_code = server.proc.wait(timeout=60)
    for thread in threads:
        thread.join(timeout=30)
    assert exit_code == 3, server.log()
    _check_cancelled(results, server.log())
    assert "--drain-timeout 1s" in server.log() and "drained, bye" not in server.log()


def test_second_ctrl_c_cancels_at_once(start_server):
    server = start_server("tiny-random-llama", "--kv-cache-memory", "64MiB")  # default drain timeout: 30 s
    threads, results, streaming = _start_cancellable_load(server)
    _wait_for_load(server, streaming)
    server.proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGINT)
    exit_code = server.proc.wait(timeout=20)
    for thread in threads:
        thread.join(timeout=30)
    assert exit_code == 3, server.log()
    _check_cancelled(results, server.log())
    assert "a second interrupt" in server.log()
