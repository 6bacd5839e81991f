"""No hangs, no orphans. A rank that loses its peers cannot recover (the ranks would disagree on
what runs next), so it exits at once with a message naming itself; torchrun's agent then stops the
other ranks and reports which one failed first. Every rank also watches its parent (torchrun
starts ranks in their own sessions, so a killed agent would otherwise leave them running)."""

from __future__ import annotations

import os
import sys
import threading
import time

PARENT_POLL_S = 0.5


def fatal(message: str, code: int = 1) -> None:
    """Print and exit now, without unwinding: other threads may be blocked in a collective."""
    try:
        sys.stderr.write(f"llmctl: {message}\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


def watch_parent(rank: int) -> None:
    """Exit when the process that started this rank (torchrun's agent) is gone."""
    parent = os.getppid()

    def poll() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                fatal(f"rank {rank}: its torchrun agent (pid {parent}) is gone; exiting")

    threading.Thread(target=poll, name="llmctl-parent-watch", daemon=True).start()
