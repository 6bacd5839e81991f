"""Prometheus metrics under an ``llmctl:`` prefix, named like vLLM's ``vllm:`` ones.

Each app has its own ``CollectorRegistry`` (several servers can live in one process, e.g. in
tests). Gauges and counters are read at scrape time from the engine's one stats surface,
``AsyncEngine.counters()`` (``llmctl/engine/stats.py``), so they cannot drift from what
``/v1/engine/stats``, ``bench`` and ``top`` show. Latency histograms observe what each step's
``StepStats`` carries (TTFT, inter-token latency, end-to-end latency, tokens computed), handed to
a listener in the engine thread right after the step.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.stats import StepStats

PREFIX = "llmctl:"
# vLLM's buckets, with finer low ends: a CPU token can take a few milliseconds
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _EngineCollector(Collector):
    """Gauges and counters read from the engine under its lock at each scrape."""

    def __init__(self, async_engine: AsyncEngine, model_name: str) -> None:
        self.async_engine = async_engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        c = self.async_engine.counters()
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("num_requests_running", "Requests with a sequence in the running batch.", c.requests_running)
        yield gauge(
            "num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).", c.requests_waiting
        )
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by live sequences (1 = full).", c.kv_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", c.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", c.prefix_cache_hits)
        yield counter("num_preemptions", "Sequences preempted to free KV blocks or for fairness.", c.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens of all accepted requests.", c.prompt_tokens_total)
        yield counter("generation_tokens", "Tokens generated.", c.generation_tokens_total)
        yield counter("spec_decode_num_drafts", "Speculative decoding: verify steps of a sequence.", c.spec_num_drafts)
        yield counter(
            "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.", c.spec_num_draft_tokens
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
            c.spec_num_accepted_tokens,
        )
        success = CounterMetricFamily(
            PREFIX + "request_success", "Requests finished, by finish reason.", labels=["model_name", "finished_reason"]
        )
        for reason, count in sorted(c.requests_finished.items()):
            success.add_metric([self.model_name, reason], count)
        yield success


class ServerMetrics:
    def __init__(self, async_engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token of finished requests.", E2E_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per engine step (prefill + decode).", ITERATION_TOKEN_BUCKETS
        )
        self.registry.register(_EngineCollector(async_engine, model_name))
        async_engine.add_step_listener(self._on_step)

    def _on_step(self, step: StepStats) -> None:
        """Runs in the engine's thread after each step."""
        self.iteration_tokens.observe(step.record.prefill_tokens + step.record.decode_tokens)
        for value in step.ttft_s:
            self.ttft.observe(value)
        for value in step.itl_s:
            self.itl.observe(value)
        for value in step.e2e_s:
            self.e2e.observe(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
