"""`KVEventLog`: numbered events for polling readers, snapshots when a reader cannot catch up, and
the replay always equal to what the pool and CPU tier hold."""

from __future__ import annotations

import pytest

from inferengine.core.block_pool import BlockPool
from inferengine.core.host_tier import HostTier
from inferengine.core.kv_event_log import KVEventLog, event_log
from inferengine.dp.router import Router


def replay(answers: list[dict]) -> tuple[set[bytes], set[bytes]]:
    router = Router(1)
    for answer in answers:
        router.apply_kv_events(0, [tuple(e) for e in answer["events"]])
    view = router.replicas[0]
    return view.cached, view.cpu_cached


def fill(pool: BlockPool, host: HostTier, tags: range) -> None:
    for tag in tags:
        block = pool.get_new_blocks(1)[0]
        pool.cache_block(block, bytes([tag]) * 16)
        pool.free_blocks([block])
        host.reserve(bytes([100 + tag]) * 16)


def test_a_new_reader_gets_a_snapshot_then_increments():
    pool, host = BlockPool(8), HostTier(4)
    fill(pool, host, range(3))  # before the log: only a snapshot can tell
    log = event_log(pool, host)
    first = log.read(0)
    assert first["snapshot"]
    fill(pool, host, range(3, 9))  # the pool and the tier reuse cached pages: removals
    second = log.read(first["next_seq"], first["epoch"])
    assert not second["snapshot"] and second["events"]
    cached, cpu_cached = replay([first, second])
    assert cached == set(pool.cached)
    assert cpu_cached == set(host.cached_hashes())
    third = log.read(second["next_seq"], second["epoch"])
    assert (third["snapshot"], third["events"]) == (False, [])


def test_a_reader_too_far_behind_or_of_another_epoch_gets_a_snapshot():
    pool, host = BlockPool(8), HostTier(4)
    log = KVEventLog(pool, host, capacity=4)
    pool.kv_events = host.kv_events = log
    start = log.read(0)
    fill(pool, host, range(6))
    assert log.read(start["next_seq"], start["epoch"])["snapshot"]  # its events fell off
    now = log.read(0, "another-epoch")
    assert now["snapshot"] and now["next_seq"] == log.next_seq
    assert replay([now]) == (set(pool.cached), set(host.cached_hashes()))
    assert len(log.events) == 4  # bounded, whether or not anyone reads


def test_a_data_parallel_replicas_list_is_not_taken_over():
    pool = BlockPool(4)
    pool.kv_events = []
    with pytest.raises(RuntimeError, match="data-parallel"):
        event_log(pool, None)
    fresh = BlockPool(4)
    assert event_log(fresh, None) is event_log(fresh, None)
