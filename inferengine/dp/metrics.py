"""Prometheus families labelled by replica, and the router's decisions, read at scrape time.

The engine-wide families (`inferengine:num_requests_running`, ...) keep their meaning: the sum
over the replicas. These add a `replica` label (and `reason` for routing decisions).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from inferengine.dp.client import DPClient
from inferengine.metrics.prometheus import PREFIX

_GAUGES = (
    ("replica_up", "1 while the replica serves, 0 while it restarts or after it died.", None),
    (
        "replica_num_requests_running",
        "Requests in the replica's running batch.",
        "num_requests_running",
    ),
    ("replica_num_requests_waiting", "Requests waiting in the replica.", "num_requests_waiting"),
    (
        "replica_num_requests_in_flight",
        "Requests the router sent there, not yet finished.",
        "requests_in_flight",
    ),
    (
        "replica_kv_cache_usage_perc",
        "The replica's KV-cache usage; 1 means 100 percent.",
        "kv_cache_usage",
    ),
    (
        "replica_prefix_cache_hit_rate",
        "Share of the replica's prompt tokens found cached.",
        "prefix_cache_hit_rate",
    ),
)
_COUNTERS = (
    (
        "replica_requests_served",
        "Requests the replica finished (all its incarnations).",
        "requests_served",
    ),
    (
        "replica_prefix_cache_queries",
        "Prompt tokens looked up (this incarnation).",
        "prefix_cache_queries",
    ),
    (
        "replica_prefix_cache_hits",
        "Prompt tokens found cached (this incarnation).",
        "prefix_cache_hits",
    ),
    ("replica_restarts", "Times the replica stopped and was restarted.", "restarts"),
)


class ReplicaCollector:
    """A custom collector: `registry.register(ReplicaCollector(model_name, client))`."""

    def __init__(self, model_name: str, client: DPClient):
        self.model_name = model_name
        self.client = client

    def collect(self) -> Iterator[Metric]:
        rows = self.client.replica_stats()
        labels = ["model_name", "replica"]
        for name, doc, key in _GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            for row in rows:
                value = float(row["status"] == "up") if key is None else float(row[key])
                family.add_metric([self.model_name, str(row["id"])], value)
            yield family
        for name, doc, key in _COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            for row in rows:
                family.add_metric([self.model_name, str(row["id"])], float(row[key]))
            yield family
        router = self.client.router_stats()
        decisions = CounterMetricFamily(
            PREFIX + "router_decisions",
            "Requests routed, by why the replica was picked (session, prefix or load).",
            labels=["model_name", "reason"],
        )
        for reason, count in router["decisions"].items():
            decisions.add_metric([self.model_name, reason], float(count))
        yield decisions
        rerouted = CounterMetricFamily(
            PREFIX + "router_rerouted_requests",
            "Requests sent to another replica after theirs stopped before they streamed.",
            labels=["model_name"],
        )
        rerouted.add_metric([self.model_name], float(router["rerouted_requests"]))
        yield rerouted
        failed = CounterMetricFamily(
            PREFIX + "router_failed_streams",
            "Streaming requests ended with an error because their replica stopped.",
            labels=["model_name"],
        )
        failed.add_metric([self.model_name], float(router["failed_streams"]))
        yield failed
