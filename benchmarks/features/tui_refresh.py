"""How many dashboard refreshes per second ``llmctl top`` sustains with a large engine.

Each refresh feeds the app a new synthetic snapshot (4,096 KV blocks, 256 live requests by
default: the map is grouped, the table full, every cell of the map and most rows change), lets the
app process the resulting messages, repaints the screen, and then encodes the whole frame as the
terminal escape sequences a real terminal would receive (``--no-encode`` skips that last part).
The app runs headless under ``App.run_test``; snapshots are pre-built, so fetching costs nothing.

    .venv/bin/python -m benchmarks.features.tui_refresh [--blocks 4096 --requests 256 --refreshes 200]

Textual internals are used on purpose (``_wait_for_screen``, ``_on_timer_update``,
``_compositor.render_update``): they force the repaint that a terminal would otherwise get on the
next frame, so each refresh is measured to the end.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import time

from llmctl.tui.app import TopApp
from llmctl.tui.sources import ReplaySource
from llmctl.tui.synthetic import synthetic_snapshot


async def measure(blocks: int, requests: int, refreshes: int, size: tuple[int, int], encode: bool) -> list[float]:
    snapshots = [synthetic_snapshot(blocks, requests, tick=t) for t in range(refreshes + 5)]
    app = TopApp(ReplaySource(snapshots), interval=None)
    durations = []
    async with app.run_test(size=size) as pilot:
        for i in range(refreshes + 5):
            start = time.perf_counter()
            await app.poll_once()
            await pilot._wait_for_screen()
            app.screen._on_timer_update()
            if encode:
                update = app.screen._compositor.render_update(full=True)
                update.render_segments(app.console)
            if i >= 5:  # the first refreshes build the layout and warm caches
                durations.append(time.perf_counter() - start)
        map_widget = app.query_one("#block-map")
        print(
            f"block map: {map_widget.size.width}x{map_widget.size.height} cells, "
            f"{map_widget.group_size} blocks per cell; table rows: {app.query_one('#requests').row_count}"
        )
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--refreshes", type=int, default=200)
    parser.add_argument("--size", default="160x48", help="terminal columns x lines")
    parser.add_argument("--no-encode", action="store_true", help="skip encoding frames for a terminal")
    args = parser.parse_args()
    size = tuple(int(v) for v in args.size.split("x"))
    durations = asyncio.run(measure(args.blocks, args.requests, args.refreshes, size, not args.no_encode))
    mean = statistics.fmean(durations)
    p95 = sorted(durations)[int(0.95 * len(durations)) - 1]
    print(
        f"{args.blocks} blocks, {args.requests} requests, {args.size} terminal, {len(durations)} refreshes: "
        f"mean {1000 * mean:.1f} ms, p95 {1000 * p95:.1f} ms -> {1 / mean:.1f} refreshes/s "
        f"({platform.processor() or platform.machine()}, Python {platform.python_version()})"
    )


if __name__ == "__main__":
    main()
