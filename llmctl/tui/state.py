"""What the dashboard knows: the latest snapshot plus the history it derives from successive ones.

Rates come from counter deltas between two snapshots divided by the time between them (the
snapshots' own ``time``), so they are exact whatever the polling interval, and a replay computes
the same numbers as the live run did. Step records overlap between snapshots (each carries the
last ~120 steps); they are merged by step number. A snapshot whose counters or uptime went
backwards means the engine restarted: the history starts over.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

HISTORY = 120  # rate samples kept for the sparklines
STEP_HISTORY = 240  # step records kept for the batch bars


@dataclass
class Rates:
    """Rates over the interval between two snapshots."""

    output_tokens_per_s: float
    prefill_tokens_per_s: float
    finished_requests_per_s: float


def _finished_total(snapshot: dict[str, Any]) -> int:
    return sum(snapshot["counters"]["requests_finished"].values())


class DashboardState:
    def __init__(self, history: int = HISTORY, step_history: int = STEP_HISTORY) -> None:
        self.snapshot: dict[str, Any] | None = None
        self.rates: Rates | None = None
        self.output_tokens_per_s: deque[float] = deque(maxlen=history)
        self.prefill_tokens_per_s: deque[float] = deque(maxlen=history)
        self.finished_requests_per_s: deque[float] = deque(maxlen=history)
        self.steps: deque[dict[str, Any]] = deque(maxlen=step_history)
        self.connected = False
        self.error: str | None = None
        self.error_kind = "disconnected"  # or "unauthorized", "not llmctl": what the header says
        self.last_update: float | None = None  # monotonic time of the last good snapshot
        self.failures = 0  # consecutive failed fetches
        self.restarts = 0

    # ---- input ---------------------------------------------------------------------------------
    def ingest(self, snapshot: dict[str, Any]) -> None:
        previous = self.snapshot
        if previous is not None and self._restarted(previous, snapshot):
            self._reset_history()
            self.restarts += 1
            previous = None
        if previous is not None:
            dt = snapshot["time"] - previous["time"]
            if dt > 0:
                self._add_rates(previous, snapshot, dt)
        self._merge_steps(snapshot.get("steps", []))
        self.snapshot = snapshot
        self.connected = True
        self.error = None
        self.failures = 0
        self.last_update = time.monotonic()

    def mark_failure(self, error: str, kind: str = "disconnected") -> None:
        self.connected = False
        self.error = error
        self.error_kind = kind
        self.failures += 1

    # ---- derived -------------------------------------------------------------------------------
    @property
    def seconds_since_update(self) -> float | None:
        return None if self.last_update is None else time.monotonic() - self.last_update

    # ---- internals -----------------------------------------------------------------------------
    @staticmethod
    def _restarted(previous: dict[str, Any], snapshot: dict[str, Any]) -> bool:
        return (
            snapshot.get("uptime_s", 0) < previous.get("uptime_s", 0)
            or snapshot.get("step", 0) < previous.get("step", 0)
            or snapshot["counters"]["generation_tokens_total"] < previous["counters"]["generation_tokens_total"]
        )

    def _reset_history(self) -> None:
        self.rates = None
        self.output_tokens_per_s.clear()
        self.prefill_tokens_per_s.clear()
        self.finished_requests_per_s.clear()
        self.steps.clear()

    def _add_rates(self, previous: dict[str, Any], snapshot: dict[str, Any], dt: float) -> None:
        generated = snapshot["counters"]["generation_tokens_total"] - previous["counters"]["generation_tokens_total"]
        finished = _finished_total(snapshot) - _finished_total(previous)
        last_step = previous.get("step", 0)
        prefill = sum(s["prefill_tokens"] for s in snapshot.get("steps", []) if s["step"] > last_step)
        self.rates = Rates(generated / dt, prefill / dt, finished / dt)
        self.output_tokens_per_s.append(self.rates.output_tokens_per_s)
        self.prefill_tokens_per_s.append(self.rates.prefill_tokens_per_s)
        self.finished_requests_per_s.append(self.rates.finished_requests_per_s)

    def _merge_steps(self, steps: list[dict[str, Any]]) -> None:
        last = self.steps[-1]["step"] if self.steps else -1
        self.steps.extend(s for s in steps if s["step"] > last)
