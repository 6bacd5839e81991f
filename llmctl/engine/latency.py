"""Recent request latencies as percentiles: the stats snapshot's ``latency`` section::

    "latency": {
      "window": 512,            # at most this many of the most recently finished requests
      "count": 37,              # how many are in the window now
      "ttft_s": {"p50": float | None, "p90": ..., "p99": ...},   # first token - arrival
      "tpot_s": {"p50": ..., "p90": ..., "p99": ...},            # (last - first token) / (tokens - 1)
      "e2e_s":  {"p50": ..., "p90": ..., "p99": ...}             # finished - arrival
    }

The engine feeds ``LatencyWindow`` every finished ``RequestOutput`` after each step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from llmctl.engine.outputs import RequestOutput

PERCENTILES = (50, 90, 99)
DEFAULT_WINDOW = 512


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """Nearest-rank percentiles (a value that was really observed); ``None`` with no data."""
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    ordered = sorted(values)
    return {f"p{p}": ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)] for p in PERCENTILES}


class LatencyWindow:
    """TTFT, TPOT and end-to-end time of the last ``window`` finished (not aborted) requests."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self.ttft: deque[float] = deque(maxlen=window)
        self.tpot: deque[float] = deque(maxlen=window)
        self.e2e: deque[float] = deque(maxlen=window)

    def observe(self, output: RequestOutput) -> None:
        """Record a request's final output; unfinished or aborted outputs are ignored."""
        if not output.finished or any(o.finish_reason == "abort" for o in output.outputs):
            return
        m = output.metrics
        if m.ttft is not None:
            self.ttft.append(m.ttft)
        if m.e2e is not None:
            self.e2e.append(m.e2e)
        tokens = max((len(o.token_ids) for o in output.outputs), default=0)
        if tokens > 1 and m.first_token_time is not None and m.last_token_time is not None:
            self.tpot.append((m.last_token_time - m.first_token_time) / (tokens - 1))

    def section(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "count": len(self.e2e),
            "ttft_s": percentiles(self.ttft),
            "tpot_s": percentiles(self.tpot),
            "e2e_s": percentiles(self.e2e),
        }
