"""Start-up time of llmctl commands that should feel instant: wall and CPU time (user + sys) of a
fresh interpreter per run, the best of N (the least disturbed by other work on the machine).

    python -m benchmarks.features.startup_time [--runs 7] [--python .venv/bin/python] [--root CHECKOUT]

``--root`` times another checkout (e.g. the commit before a change): each command runs there.

``top --url`` is timed as what it must import before its first frame (the CLI, Textual, the HTTP
client and the dashboard), since a full-screen app cannot run without a terminal.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import cpu_line

COMMANDS = {
    "llmctl --help": ["--help"],
    "llmctl ls": ["ls"],
    "llmctl rm --help": ["rm", "--help"],
    "llmctl top --help": ["top", "--help"],
    "llmctl generate --help": ["generate", "--help"],
    "llmctl top --url (imports)": None,
}
TOP_IMPORTS = "import llmctl.cli, llmctl.tui.app, llmctl.tui.sources"


def run_once(python: str, args: list[str] | None, env: dict[str, str], root: str) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    argv = [python, "-m", "llmctl.cli", *args] if args is not None else [python, "-c", TOP_IMPORTS]
    subprocess.run(argv, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    args = parser.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=args.root)
    print(f"# {args.root}: {cpu_line()}, load average {os.getloadavg()[0]:.1f}, best of {args.runs}")
    print("| command | wall s (best) | wall s (median) | CPU s (best) |")
    print("|---|---|---|---|")
    for label, cmd in COMMANDS.items():
        runs = [run_once(args.python, cmd, env, args.root) for _ in range(args.runs)]
        walls = [w for w, _ in runs]
        print(f"| `{label}` | {min(walls):.2f} | {statistics.median(walls):.2f} | {min(c for _, c in runs):.2f} |")


if __name__ == "__main__":
    main()
