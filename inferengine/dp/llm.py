"""`DataParallelLLM`: `AsyncLLM` over data-parallel replicas, for `serve --data-parallel-size N`.

Everything of `AsyncLLM` stays (tokenizing, detokenizing, one collector per request, the
output handler): only its engine-core client is a `DPClient`. Requests whose replica died while
they streamed end with `EngineDeadError` (an error event in a stream, 503 otherwise); `/stats`
gains `replicas` and `router`, and `/metrics` the per-replica families of `dp/metrics.py`.
"""

from __future__ import annotations

from typing import Any

from inferengine.config import EngineConfig
from inferengine.dp.client import DPClient
from inferengine.engine.async_llm import AsyncLLM
from inferengine.errors import OverloadedError
from inferengine.metrics.stats import StatLogger


class DataParallelLLM(AsyncLLM):
    client: DPClient

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None):
        super().__init__(config, stat_loggers)
        from inferengine.dp.metrics import ReplicaCollector

        for stat_logger in self.stat_loggers:
            registry = getattr(stat_logger, "registry", None)
            if registry is not None:
                registry.register(ReplicaCollector(self.model_config.name, self.client))

    def _make_client(self, config: EngineConfig) -> DPClient:
        from inferengine.dp.ray_backend import start_replicas

        client = DPClient(config, start_replicas(config))
        client.on_failed = self._fail_requests
        return client

    def _fail_requests(self, core_ids: list[str], error: BaseException) -> None:
        """End the user requests these engine requests belong to with `error`."""
        lost = set(core_ids)
        for parent, children in list(self.children.items()):
            if lost.intersection(children):
                collector = self.collectors.get(parent)
                if collector is not None:
                    collector.put(error)

    def _check_capacity(self) -> None:
        limit = self.config.scheduler_config.max_waiting_requests
        if limit is None:
            return
        per_replica = self.config.scheduler_config.max_num_seqs + limit
        capacity = per_replica * max(1, self.client.router.num_up)
        if len(self.collectors) >= capacity:
            raise OverloadedError(
                f"the server is at capacity ({capacity} requests in flight); retry shortly."
            )

    def get_stats(self) -> dict[str, Any]:
        body = super().get_stats()
        body["data_parallel_size"] = len(self.client.slots)
        body["replicas"] = self.client.replica_stats()
        body["router"] = self.client.router_stats()
        return body
