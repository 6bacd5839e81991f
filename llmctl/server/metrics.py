"""Prometheus metrics under an ``llmctl:`` prefix, named like vLLM's ``vllm:`` ones.

Each app has its own ``CollectorRegistry`` (several servers can live in one process, e.g. in
tests). Gauges and counters are read from the engine at scrape time by a custom collector, so
they cannot drift from the engine's own numbers. Latency histograms need every step, so they are
fed by a listener on ``LLMEngine.step`` that runs in the engine thread right after each step,
while the engine lock is still held: per request TTFT, inter-token latency and end-to-end
latency, and per step the number of tokens it computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import StepRecord
from llmctl.engine.outputs import RequestOutput
from llmctl.engine.sequence import SequenceStatus

PREFIX = "llmctl:"
# vLLM's buckets, with finer low ends: a CPU token can take a few milliseconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

class _EngineCollector(Collector):
    """Gauges and counters read from the engine under its lock at each scrape."""

    def __init__(self, async_engine: AsyncEngine, model_name: str) -> None:
        self.async_engine = async_engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        engine = self.async_engine.engine
        with self.async_engine.lock:
            running = sum(1 for r in engine.requests.values()
                          if any(s.status is SequenceStatus.RUNNING for s in r.seqs))
            waiting = len(engine.requests) - running
            usage = engine.block_manager.usage
            sched = engine.scheduler
            queries, hits, preemptions = sched.prefix_query_tokens, sched.prefix_hit_tokens, sched.num_preemptions
            prompt_tokens, generation_tokens = engine.prompt_tokens_total, engine.generation_tokens_total
            finished = dict(engine.finished_requests)
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield gauge("num_requests_running", "Requests with a sequence in the running batch.", running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).", waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks held by live sequences (1 = full).", usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", hits)
        yield counter("num_preemptions", "Sequences preempted to free KV blocks or for fairness.", preemptions)
        yield counter("prompt_tokens", "Prompt tokens of all accepted requests.", prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", generation_tokens)
        success = CounterMetricFamily(PREFIX + "request_success", "Requests finished, by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, count in sorted(finished.items()):
            success.add_metric([self.model_name, reason], count)
        yield success


class ServerMetrics:
    def __init__(self, async_engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive tokens of a request.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token of finished requests.",
                             E2E_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens computed per engine step "
                                          "(prefill + decode).", ITERATION_TOKEN_BUCKETS)
        self.registry.register(_EngineCollector(async_engine, model_name))
        self._last_token_time: dict[str, float] = {}
        self._engine = async_engine.engine
        self._engine.step_listeners.append(self._on_step)

    def _on_step(self, outputs: list[RequestOutput], record: StepRecord) -> None:
        """Runs in the engine's thread after each step."""
        engine = self._engine
        self.iteration_tokens.observe(record.prefill_tokens + record.decode_tokens)
        for out in outputs:
            metrics = out.metrics
            previous = self._last_token_time.get(out.request_id)
            if metrics.last_token_time is not None:
                if previous is None:
                    if metrics.ttft is not None:
                        self.ttft.observe(metrics.ttft)
                else:
                    self.itl.observe(metrics.last_token_time - previous)
                self._last_token_time[out.request_id] = metrics.last_token_time
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                if metrics.e2e is not None:
                    self.e2e.observe(metrics.e2e)
        if len(self._last_token_time) > 2 * len(engine.requests) + 64:  # forget aborted requests
            self._last_token_time = {k: v for k, v in self._last_token_time.items() if k in engine.requests}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
