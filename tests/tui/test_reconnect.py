"""A real HTTP server that goes away and comes back (restarted, its counters from zero): the
dashboard shows the banner meanwhile and picks the new engine up by itself."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tui_helpers import drive, shown_text

from llmctl.tui.app import TopApp
from llmctl.tui.requests_table import RequestsTable
from llmctl.tui.sources import HttpSource


class StatsServer:
    """Serves the given snapshots in turn at /v1/engine/stats, like ``llmctl serve`` would."""

    def __init__(self, snapshots: list[dict], port: int = 0) -> None:
        feed = iter(snapshots)
        last: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                if self.path != "/v1/engine/stats":
                    self.send_error(404)
                    return
                last[:] = [next(feed, last[0] if last else {})]
                body = json.dumps(last[0]).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def test_server_goes_away_and_comes_back(snapshots):
    server = StatsServer(snapshots[4:8])
    url = f"http://127.0.0.1:{server.port}"

    async def scenario(app, pilot):
        nonlocal server
        for _ in range(3):
            await app.poll_once()
        await pilot.pause()
        assert app.state.connected and app.state.snapshot["step"] == snapshots[6]["step"]
        assert len(app.state.output_tokens_per_s) == 2
        server.stop()
        await app.poll_once()
        await pilot.pause()
        banner = app.query_one("#banner")
        assert banner.display and "disconnected — retrying" in shown_text(banner)
        assert app.query_one("#body").has_class("-stale")
        assert app.query_one(RequestsTable).row_count == len(snapshots[6]["requests"])  # last data kept
        server = StatsServer(snapshots[0:3], port=server.port)  # a fresh engine: counters from zero
        await app.poll_once()
        await pilot.pause()
        assert app.state.connected and not banner.display
        assert app.state.snapshot["step"] == snapshots[0]["step"] and app.state.restarts == 1
        assert sorted(app.query_one(RequestsTable).row_ids) == sorted(r["id"] for r in snapshots[0]["requests"])
        await app.poll_once()
        assert len(app.state.output_tokens_per_s) == 1  # rates start over with the new engine

    try:
        drive(TopApp(HttpSource(url, timeout_s=2.0), interval=None), scenario)
    finally:
        server.stop()
