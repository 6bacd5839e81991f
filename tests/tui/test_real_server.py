"""``llmctl top`` against real ``llmctl serve`` processes: it shows the requests a client sends,
says so when the key is wrong, and survives the server being stopped and started again."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import httpx
import pytest
from tui_helpers import drive, shown_text

from llmctl.tui.app import TopApp
from llmctl.tui.requests_table import RequestsTable
from llmctl.tui.sources import HttpSource, SourceError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from server_helpers import API_KEY, ServerProcess  # noqa: E402

FLAGS = ("--kv-cache-memory", "16MiB", "--api-key", API_KEY)


def send_completions(url: str, count: int, max_tokens: int) -> list[threading.Thread]:
    def one(i: int) -> None:
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
            try:
                client.post(
                    "/v1/completions",
                    json={
                        "model": "tiny-random-llama",
                        "prompt": f"story number {i}",
                        "max_tokens": max_tokens,
                        "ignore_eos": True,
                        "user": f"client{i % 2}",
                    },
                )
            except httpx.HTTPError:
                pass  # the test kills the server under these requests

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def test_top_follows_a_real_server_across_a_restart(tmp_path):
    server = ServerProcess("tiny-random-llama", *FLAGS, log_path=tmp_path / "first.log")
    port = server.url.rsplit(":", 1)[1]
    servers = [server]

    async def scenario(app, pilot):
        wrong = HttpSource(server.url, api_key="wrong")
        with pytest.raises(SourceError, match="HTTP 401"):
            await wrong.fetch()
        await wrong.close()

        clients = send_completions(server.url, 4, max_tokens=400)
        for _ in range(100):
            await app.poll_once()
            if app.state.snapshot and len(app.state.snapshot["requests"]) == 4:
                break
            await pilot.pause(0.1)
        await pilot.pause()
        table = app.query_one(RequestsTable)
        assert table.row_count == 4
        assert {table.get_row(i)[1] for i in table.row_ids} == {"client0", "client1"}
        assert "● live" in shown_text(app.query_one("#status")) and "in flight" in shown_text(app.query_one("#status"))

        server.kill()  # gone without a word
        for thread in clients:
            thread.join(timeout=30)
        await app.poll_once()
        await pilot.pause()
        assert app.query_one("#banner").display and app.query_one("#body").has_class("-stale")
        assert table.row_count == 4  # the last data stays

        again = ServerProcess("tiny-random-llama", *FLAGS, "--port", port, log_path=tmp_path / "second.log")
        servers.append(again)
        await app.poll_once()
        await pilot.pause()
        assert app.state.connected and not app.query_one("#banner").display
        assert app.state.restarts == 1 and table.row_count == 0

    try:
        drive(TopApp(HttpSource(server.url, api_key=API_KEY), interval=None), scenario)
    finally:
        for s in servers:
            s.kill()
