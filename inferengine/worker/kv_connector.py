"""`KVConnectorWorker`: the worker's half of disaggregated prefill/decode (`kv_transfer/`).

Per step, for the model runner, once the step's forward is launched: start the fetches the
scheduler listed (their pages belong to requests that do not run yet), publish the pages the
forward completes, and report what ended, with each fetch's time and bytes. A fetch not done
by its deadline (`kv_load_timeout_s`, or a second before the producer's hold ends) is cancelled
and reported failed, so the scheduler recomputes the prompt: nothing waits forever. A step with
no tokens (only fetches in flight) sleeps a moment, so the idle loop polls without spinning.
"""

from __future__ import annotations

import time

import torch

from inferengine.config import KVTransferConfig
from inferengine.core.sched_output import KVFetch, KVTransferEvents, SchedulerOutput
from inferengine.kv_transfer.base import KVTransport, page_bytes
from inferengine.kv_transfer.select import make_transport
from inferengine.logger import init_logger

logger = init_logger(__name__)

IDLE_POLL_S = 0.002  # an empty step's pause while fetches are in flight
EXPIRY_MARGIN_S = 1.0  # a fetch gives up this long before the producer frees the pages


class KVConnectorWorker:
    def __init__(self, config: KVTransferConfig, kv_caches: list[torch.Tensor], block_size: int):
        self.config = config
        self.transport: KVTransport = make_transport(config, kv_caches, block_size)
        self.page_bytes = page_bytes(kv_caches)
        # Fetches in flight: request -> (start, deadline, bytes), on time.monotonic()
        self.pending: dict[str, tuple[float, float, int]] = {}
        self.cancelling: set[str] = set()
        self.failed: list[str] = []  # fetches that could not start

    def start_fetches(self, fetches: list[KVFetch]) -> None:
        now, wall = time.monotonic(), time.time()
        for fetch in fetches:
            deadline = now + self.config.kv_load_timeout_s
            expires_at = fetch.params.get("expires_at")
            if isinstance(expires_at, int | float):
                deadline = min(deadline, now + expires_at - wall - EXPIRY_MARGIN_S)
            self.pending[fetch.req_id] = (now, deadline, len(fetch.block_ids) * self.page_bytes)
            if deadline <= now:  # the producer frees the pages before a copy could be trusted
                logger.warning("KV transfer %s: the producer's hold ends too soon", fetch.req_id)
                self.failed.append(fetch.req_id)
                continue
            try:
                self.transport.start_fetch(fetch)
            except Exception as e:
                logger.warning("KV transfer %s: the fetch failed to start (%s)", fetch.req_id, e)
                self.transport.cancel(fetch.req_id)
                self.failed.append(fetch.req_id)

    def publish(self, publishes: dict[str, list[int]]) -> tuple[dict[str, dict | None], list[str]]:
        """Publish pages this step computed: each request's transport params (None: failed),
        and the requests whose device pages are free already."""
        published: dict[str, dict | None] = {}
        pushed = []
        for req_id, block_ids in publishes.items():
            try:
                published[req_id], done = self.transport.publish(req_id, block_ids)
            except Exception as e:
                logger.warning("KV transfer: publishing %s failed (%s)", req_id, e)
                published[req_id], done = None, False
            if done:
                pushed.append(req_id)
        return published, pushed

    def step(self, so: SchedulerOutput) -> KVTransferEvents | None:
        """After the step's forward is launched: start its fetches, publish the pages it
        computes, and collect what ended."""
        if so.kv_fetches:
            self.start_fetches(so.kv_fetches)
        published, released = self.publish(so.kv_publishes) if so.kv_publishes else ({}, [])
        idle = so.is_empty
        done_sending, done = self.transport.poll()
        if idle and not (done_sending or done) and self.transport.busy:
            time.sleep(IDLE_POLL_S)
        events = KVTransferEvents(published=published, released=[*released, *done_sending])
        now = time.monotonic()
        for req_id in self.failed:
            events.fetched[req_id] = self._outcome(req_id, False, now)
        self.failed = []
        for req_id, ok in done.items():
            if req_id in self.pending:
                events.fetched[req_id] = self._outcome(req_id, ok, now)
        for req_id, (_, deadline, _) in list(self.pending.items()):
            if deadline > now:
                continue
            if req_id not in self.cancelling:
                logger.warning("KV transfer %s: the fetch timed out; cancelling it", req_id)
                self.cancelling.add(req_id)
            if self.transport.cancel(req_id):  # else a copy still writes its pages: next step
                self.cancelling.discard(req_id)
                events.fetched[req_id] = self._outcome(req_id, False, now)
        return events if events else None

    def _outcome(self, req_id: str, ok: bool, now: float) -> tuple[bool, float, int]:
        start, _, nbytes = self.pending.pop(req_id, (now, now, 0))
        return ok, now - start, nbytes if ok else 0

    def close(self) -> None:
        self.transport.close()
