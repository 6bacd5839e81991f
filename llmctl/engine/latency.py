"""Latency percentiles: the one percentile function every report uses (engine stats, ``top``,
``bench``), and the stats snapshot's ``latency`` section::

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


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between order statistics (``numpy.percentile``'s default): the p-th
    percentile of sorted ``x[0..n-1]`` sits at rank ``r = p/100 * (n-1)`` and is
    ``x[floor r] + (r - floor r) * (x[ceil r] - x[floor r])``."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """P50/P90/P99 by ``percentile``; ``None`` with no data."""
    return {f"p{p}": (percentile(values, p) if values else None) for p in PERCENTILES}


class LatencyWindow:
    """TTFT, TPOT and end-to-end time of the last ``window`` finished (not aborted) requests."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        self.window = window
        self.ttft: deque[float] = deque(maxlen=window)
        self.tpot: deque[float] = deque(maxlen=window)
        self.e2e: deque[float] = deque(maxlen=window)

    def observe(self, output: RequestOutput) -> None:
        """Record a request's final output; unfinished, aborted or failed outputs are ignored."""
        if not output.finished or output.error is not None or any(o.finish_reason == "abort" for o in output.outputs):
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
