"""Benchmark arithmetic, kept pure so it can be checked against hand-computed timelines.

Per request (all times in seconds, on one monotonic clock):

- **TTFT** = first token time - start (start = when the request was sent, not when it was generated).
- **E2E** = end - start.
- **TPOT** (time per output token after the first) = (E2E - TTFT) / (output tokens - 1); undefined,
  and left out of the TPOT statistics, for a request with a single output token.
- **ITL** (inter-token latency) = the gaps between successive streamed chunks after the first; a
  chunk carrying several tokens counts once, as a client sees it.

Over a run: throughputs divide by the run's duration (first send to last end); latencies are
summarised by mean, median, P90 and P99 over the requests that succeeded, with the one percentile
function the engine's stats and ``top`` use too (``llmctl.engine.latency.percentile``: linear
interpolation between order statistics, ``numpy.percentile``'s default).

**Goodput** is the rate of requests that met every SLO given (TTFT <= slo_ttft, TPOT <= slo_tpot;
a single-token request has no TPOT and meets the TPOT SLO), divided by the same duration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmctl.engine.latency import percentile


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    start: float
    end: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk holding >= 1 token
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (when the target says)
    ok: bool = True
    error: str = ""

    @property
    def first_token_time(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def ttft(self) -> float | None:
        first = self.first_token_time
        return None if first is None else first - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def succeeded(self) -> bool:
        return self.ok and self.output_tokens > 0 and self.first_token_time is not None


@dataclass
class Distribution:
    """Summary of one latency, in milliseconds. ``count`` is 0 (and the rest None) when nothing was
    measured, e.g. TPOT when every request produced one token."""

    count: int
    mean: float | None = None
    median: float | None = None
    p90: float | None = None
    p99: float | None = None

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(0)
        ms = [v * 1000 for v in values]
        return cls(len(ms), sum(ms) / len(ms), percentile(ms, 50), percentile(ms, 90), percentile(ms, 99))


@dataclass
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        if not record.succeeded:
            return False
        if self.ttft_ms is not None and record.ttft * 1000 > self.ttft_ms:
            return False
        tpot = record.tpot
        return not (self.tpot_ms is not None and tpot is not None and tpot * 1000 > self.tpot_ms)


@dataclass
class Summary:
    duration_s: float
    num_requests: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    slo: Slo
    good_requests: int
    goodput: float  # requests meeting every SLO / s
    errors: list[str] = field(default_factory=list)  # the first few distinct error messages

    @property
    def stream_tokens_per_s_p99(self) -> float | None:
        """Decode speed of the slowest streams: 1 / P99 TPOT."""
        return 1000 / self.tpot_ms.p99 if self.tpot_ms.p99 else None

    @property
    def stream_tokens_per_s_median(self) -> float | None:
        return 1000 / self.tpot_ms.median if self.tpot_ms.median else None


def summarize(records: Sequence[RequestRecord], slo: Slo | None = None, duration_s: float | None = None) -> Summary:
    """Aggregate a run. ``duration_s`` defaults to first start -> last end over all records."""
    slo = slo or Slo()
    if duration_s is None:
        duration_s = (max(r.end for r in records) - min(r.start for r in records)) if records else 0.0
    done = [r for r in records if r.succeeded]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if slo.met_by(r))

    def rate(x: float) -> float:
        return x / duration_s if duration_s > 0 else 0.0

    errors: list[str] = []
    for r in records:
        message = r.error or ("no output tokens" if r.ok else "failed")
        if not r.succeeded and message not in errors and len(errors) < 5:
            errors.append(message)
    return Summary(
        duration_s=duration_s,
        num_requests=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=rate(len(done)),
        output_throughput=rate(output_tokens),
        total_token_throughput=rate(input_tokens + output_tokens),
        ttft_ms=Distribution.of_seconds([r.ttft for r in done]),
        tpot_ms=Distribution.of_seconds([t for r in done if (t := r.tpot) is not None]),
        itl_ms=Distribution.of_seconds([gap for r in done for gap in r.itls]),
        e2e_ms=Distribution.of_seconds([r.e2e for r in done]),
        slo=slo,
        good_requests=good,
        goodput=rate(good),
        errors=errors,
    )
