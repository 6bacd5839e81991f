"""The router's own Prometheus metrics, in a registry of its own (``GET /metrics`` of the router).

Replica gauges are read from the replica set at scrape time, so a replica that discovery removed
disappears from the exposition instead of freezing at its last value.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmctl.router.replicas import ReplicaSet

TTFB_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _ReplicaCollector(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "llmctl:router_replica_healthy", "1 while the replica is in rotation.", labels=["replica"]
        )
        in_flight = GaugeMetricFamily(
            "llmctl:router_replica_in_flight",
            "Requests this router is proxying to the replica now.",
            labels=["replica"],
        )
        for replica in self.replicas.all():
            healthy.add_metric([replica.url], float(replica.healthy))
            in_flight.add_metric([replica.url], float(replica.in_flight))
        yield healthy
        yield in_flight


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "llmctl:router_requests",
            "Requests answered, by replica and HTTP status.",
            ["replica", "code"],
            registry=self.registry,
        )
        self.decisions = Counter(
            "llmctl:router_routing_decisions",
            "Routing decisions, by why that replica.",
            ["reason"],
            registry=self.registry,
        )
        self.retries = Counter(
            "llmctl:router_retries",
            "Requests sent again to another replica, by what failed first.",
            ["reason"],
            registry=self.registry,
        )
        self.failures = Counter(
            "llmctl:router_failures",
            "Requests the router could not complete, by cause.",
            ["reason"],
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "llmctl:router_time_to_first_byte_seconds",
            "Arrival at the router to the first byte of the chosen replica's answer.",
            buckets=TTFB_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_ReplicaCollector(replicas))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
