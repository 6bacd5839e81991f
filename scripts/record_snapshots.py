"""Record ``stats_snapshot()``s of a real engine under a mixed load, as JSON lines.

The fixture of the dashboard's tests and the README's picture come from:

    .venv/bin/python scripts/record_snapshots.py tests/tui/fixtures/snapshots.jsonl \
        --screenshot docs/img/llmctl-top.svg

It steps an ``LLMEngine`` on the embedded model (random weights) itself, adding requests from the
same mix as ``llmctl top --local`` at a simulated arrival rate, and writes a snapshot every
``--every`` steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import Counter
from pathlib import Path

from llmctl.config import parse_size
from llmctl.engine.llm_engine import LLMEngine
from llmctl.errors import InvalidRequestError
from llmctl.tui.load import LoadProfile, RequestMix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    parser.add_argument("--steps", type=int, default=192, help="engine steps to run")
    parser.add_argument("--every", type=int, default=12, help="snapshot every this many steps")
    parser.add_argument("--max-steps-kept", type=int, default=40, help="step records per snapshot")
    parser.add_argument("--kv-cache-memory", default="40MiB", help="small, so the pool fills up")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--arrivals-per-step", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--screenshot", type=Path, help="also save an SVG of `llmctl top` replaying them")
    parser.add_argument("--screenshot-at", type=int, default=12, help="snapshot index shown in the SVG")
    parser.add_argument("--no-record", action="store_true", help="only take the screenshot, of OUTPUT as it is")
    args = parser.parse_args()
    if not args.no_record:
        record(args)
    if args.screenshot:
        snapshots = [json.loads(line) for line in args.output.read_text().splitlines() if line.strip()]
        asyncio.run(save_screenshot(snapshots, args.screenshot_at, args.screenshot, label=args.output.name))
        print(f"saved {args.screenshot}")


def record(args: argparse.Namespace) -> None:

    engine = LLMEngine(
        kv_cache_memory=parse_size(args.kv_cache_memory),
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        num_threads=args.threads,
    )
    mix = RequestMix(LoadProfile(seed=args.seed))
    rng = random.Random(args.seed)
    lines = []
    for step in range(1, args.steps + 1):
        arrivals = sum(1 for _ in range(8) if rng.random() < args.arrivals_per_step / 8)
        if step < 6:
            arrivals += 3  # a quick start, so early snapshots are busy too
        for _ in range(arrivals):
            spec = mix.next_request()
            try:
                engine.add_request(spec.prompt, spec.params, user=spec.user)
            except InvalidRequestError:
                continue
        engine.step()
        if step % args.every == 0 or step == 3:  # step 3: the pool still filling up
            snapshot = engine.stats_snapshot(max_steps=args.max_steps_kept)
            lines.append(json.dumps(snapshot, separators=(",", ":")))
            states = Counter(r["state"] for r in snapshot["requests"])
            print(
                f"step {step}: {dict(states)}, kv {dict(Counter(snapshot['kv']['block_states']))}, "
                f"preemptions {snapshot['counters']['num_preemptions']}, {len(lines[-1]) / 1024:.1f} KiB",
                flush=True,
            )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} snapshots, {args.output.stat().st_size / 1024:.0f} KiB to {args.output}")


async def save_screenshot(snapshots: list[dict], upto: int, path: Path, label: str) -> None:
    """Replay the snapshots up to ``upto`` in a 160x48 headless terminal, select the request
    holding the most blocks (to show its blocks lit on the map), and save the screen as SVG."""
    from llmctl.tui.app import TopApp
    from llmctl.tui.requests_table import RequestsTable
    from llmctl.tui.sources import ReplaySource

    app = TopApp(ReplaySource(snapshots[: upto + 1], label=f"replay of {label}"), interval=None)
    async with app.run_test(size=(160, 48)) as pilot:
        for _ in range(upto + 1):
            await app.poll_once()
        table = app.query_one(RequestsTable)
        biggest = max(snapshots[upto]["requests"], key=lambda r: len(r["blocks"]))
        table.focus()
        table.move_cursor(row=table.get_row_index(biggest["id"]))
        await pilot.press("enter")
        await pilot.pause()
        path.parent.mkdir(parents=True, exist_ok=True)
        app.save_screenshot(filename=path.name, path=str(path.parent))


if __name__ == "__main__":
    main()
