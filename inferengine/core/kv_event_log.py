"""`KVEventLog`: the KV events of one engine, numbered and bounded, for routers that poll them.

An HTTP engine's router (`inferengine router`) asks for the events after the last one it has
seen (`GET /kv_events?since=N` on the API server, the `kv_events` utility in the core). The log
becomes the block pool's (and CPU tier's) `kv_events` sink on the first call, so an engine that
no router polls records nothing. It keeps the last `capacity` events: a reader that fell further
behind, a new reader, or one that saw another incarnation of the engine (`epoch`) gets a snapshot
instead (a clear of both tiers, then every hash each holds as stored), which replays to the same
sets. Memory stays bounded whether or not anyone polls.
"""

from __future__ import annotations

import uuid
from collections import deque
from typing import Any

from inferengine.core.block_pool import (
    KV_CLEARED,
    KV_CPU_CLEARED,
    KV_CPU_STORED,
    KV_STORED,
    BlockPool,
    KVEvent,
)
from inferengine.core.host_tier import HostTier

DEFAULT_CAPACITY = 1 << 16


class KVEventLog:
    """A sink with `append` (what `BlockPool` and `HostTier` call) that numbers each event."""

    def __init__(self, pool: BlockPool, host: HostTier | None, capacity: int = DEFAULT_CAPACITY):
        self.pool = pool
        self.host = host
        self.epoch = uuid.uuid4().hex  # new with each engine (and each log)
        self.events: deque[KVEvent] = deque(maxlen=capacity)
        self.next_seq = 0  # the number the next event gets

    def append(self, event: KVEvent) -> None:
        self.events.append(event)
        self.next_seq += 1

    def read(self, since: int, epoch: str | None = None) -> dict[str, Any]:
        """The events numbered `since` and later, or a snapshot when those are gone (or the
        reader's `epoch` is not this log's): {"epoch", "next_seq", "snapshot", "events"}."""
        first = self.next_seq - len(self.events)
        if epoch == self.epoch and first <= since <= self.next_seq:
            events = list(self.events)[since - first :]
            return self._answer(False, events)
        return self._answer(True, self.snapshot())

    def snapshot(self) -> list[KVEvent]:
        events: list[KVEvent] = [(KV_CLEARED, b""), (KV_CPU_CLEARED, b"")]
        events += [(KV_STORED, h) for h in self.pool.cached]
        if self.host is not None:
            events += [(KV_CPU_STORED, h) for h in self.host.cached_hashes()]
        return events

    def _answer(self, snapshot: bool, events: list[KVEvent]) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "next_seq": self.next_seq,
            "snapshot": snapshot,
            "events": [[kind, h] for kind, h in events],
        }


def event_log(pool: BlockPool, host: HostTier | None) -> KVEventLog:
    """The pool's log, made its (and the CPU tier's) event sink on first use. Refused where a
    data-parallel replica already takes the events as a list (its own router reads them)."""
    sink = pool.kv_events
    if isinstance(sink, KVEventLog):
        return sink
    if sink is not None:
        raise RuntimeError("this engine's KV events go to its data-parallel router")
    log = KVEventLog(pool, host)
    pool.kv_events = log  # type: ignore[assignment]  # duck-typed: only `append` is called
    if host is not None:
        host.kv_events = log  # type: ignore[assignment]
    return log
