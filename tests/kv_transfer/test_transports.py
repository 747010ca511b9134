"""The transports: pages published by one engine's worker half arrive byte for byte in the pages
another allocated; a fetch that cannot finish times out and says so; published pages expire."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from inferengine.config import KVTransferConfig
from inferengine.core.sched_output import KVFetch, SchedulerOutput
from inferengine.errors import ConfigError
from inferengine.kv_transfer.nixl import import_nixl
from inferengine.worker.kv_connector import KVConnectorWorker

LAYERS, PAGES, BLOCK, HEADS, DIM = 3, 12, 4, 2, 8


def caches(seed: int | None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (2, PAGES, BLOCK, HEADS, DIM)
    return [
        torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape)
        for _ in range(LAYERS)
    ]


def _nixl_available() -> bool:
    try:
        import_nixl()
        return True
    except ImportError:
        return False


CONNECTORS = [
    "SharedMemoryConnector",
    pytest.param(
        "NixlConnector",
        marks=pytest.mark.skipif(not _nixl_available(), reason="NIXL is not installed"),
    ),
]


def worker(connector: str, role: str, kv: list[torch.Tensor], tmp: Path, **extra):
    config = KVTransferConfig(kv_role=role, kv_connector=connector, kv_buffer_dir=str(tmp), **extra)
    return KVConnectorWorker(config, kv, BLOCK)


def step(half: KVConnectorWorker, fetches=(), publishes=None):
    so = SchedulerOutput([], [], {}, 0, kv_fetches=list(fetches), kv_publishes=publishes or {})
    return half.step(so)


def params_of(producer: KVConnectorWorker, req_id: str, block_ids: list[int]) -> dict:
    events = step(producer, publishes={req_id: block_ids})
    transport = events.published[req_id]
    return {"remote_request_id": req_id, "remote_block_ids": block_ids, **transport}


def fetch_and_wait(consumer: KVConnectorWorker, fetch: KVFetch, timeout: float = 10.0):
    """Start `fetch` and step until it ends: (ok, seconds, bytes)."""
    events = step(consumer, [fetch])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if events is not None and fetch.req_id in events.fetched:
            return events.fetched[fetch.req_id]
        events = step(consumer)
    raise AssertionError("the fetch never ended")


@pytest.mark.parametrize("connector", CONNECTORS)
def test_pages_arrive_byte_for_byte_and_the_producer_hears_of_it(connector, tmp_path):
    src, dst = caches(1), caches(None)
    producer = worker(connector, "kv_producer", src, tmp_path)
    consumer = worker(connector, "kv_consumer", dst, tmp_path)
    params = params_of(producer, "req-1", [3, 7, 9])
    fetch = KVFetch("c-1", params, remote_block_ids=[3, 7], block_ids=[10, 2])
    ok, seconds, nbytes = fetch_and_wait(consumer, fetch)
    assert ok and seconds >= 0
    assert nbytes == 2 * LAYERS * 2 * BLOCK * HEADS * DIM * 4
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[:, 10], s[:, 3]) and torch.equal(d[:, 2], s[:, 7])
        assert not d[:, [0, 1, 3, 4, 5, 6, 7, 8, 9, 11]].any()  # nothing else written
    released = []
    for _ in range(200):  # NIXL's notification may take a moment
        events = step(producer)
        released += events.released if events is not None else []
        if "req-1" in released or connector == "SharedMemoryConnector":
            break
        time.sleep(0.01)
    if connector == "NixlConnector":
        assert released == ["req-1"]
    else:  # pushed into a file when published; the consumer deleted it
        assert not list(tmp_path.iterdir())
    producer.close()
    consumer.close()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_fetch_of_no_pages_releases_the_producer(connector, tmp_path):
    """A consumer whose own prefix cache holds every page fetches none: the fetch succeeds at
    once and the producer still learns it may free its pages."""
    src, dst = caches(1), caches(None)
    producer = worker(connector, "kv_producer", src, tmp_path)
    consumer = worker(connector, "kv_consumer", dst, tmp_path)
    params = params_of(producer, "req-0", [3, 7])
    ok, _, nbytes = fetch_and_wait(consumer, KVFetch("c-0", params, [], []))
    assert (ok, nbytes) == (True, 0)
    assert not any(d.any() for d in dst)
    released = []
    for _ in range(200):
        events = step(producer)
        released += events.released if events is not None else []
        if "req-0" in released or connector == "SharedMemoryConnector":
            break
        time.sleep(0.01)
    if connector == "NixlConnector":
        assert released == ["req-0"]
    else:
        assert not list(tmp_path.iterdir())
    producer.close()
    consumer.close()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_fetch_of_pages_that_never_come_times_out(connector, tmp_path):
    consumer = worker(connector, "kv_consumer", caches(None), tmp_path, kv_load_timeout_s=0.2)
    producer = worker(connector, "kv_producer", caches(1), tmp_path)
    params = params_of(producer, "gone", [1])
    if connector == "SharedMemoryConnector":
        Path(params["shm_path"]).unlink()  # the producer's file is gone
    else:
        params["nixl_metadata"] = "bm90IGFuIGFnZW50"  # an agent that does not exist
    start = time.monotonic()
    ok, _, nbytes = fetch_and_wait(
        consumer, KVFetch("c", params, remote_block_ids=[1], block_ids=[4])
    )
    assert (ok, nbytes) == (False, 0)
    assert time.monotonic() - start < 5
    producer.close()


def test_an_expired_producer_hold_is_not_fetched(tmp_path):
    producer = worker("SharedMemoryConnector", "kv_producer", caches(1), tmp_path)
    consumer = worker("SharedMemoryConnector", "kv_consumer", caches(None), tmp_path)
    params = params_of(producer, "late", [1])
    params["expires_at"] = time.time() + 0.5  # less than the safety margin left
    ok, _, _ = fetch_and_wait(consumer, KVFetch("c", params, remote_block_ids=[1], block_ids=[2]))
    assert not ok


def test_shared_memory_files_expire_and_go_at_shutdown(tmp_path):
    producer = worker(
        "SharedMemoryConnector", "kv_producer", caches(1), tmp_path, kv_hold_timeout_s=0.2
    )
    params_of(producer, "a", [1, 2])
    assert len(list(tmp_path.iterdir())) == 1
    time.sleep(0.3)
    step(producer)
    assert not list(tmp_path.iterdir())
    params_of(producer, "b", [1])
    producer.close()
    assert not list(tmp_path.iterdir())


def test_a_consumer_reads_only_page_files_in_its_folder(tmp_path):
    victim = tmp_path / "precious"
    victim.write_bytes(b"x" * 64)
    consumer = worker("SharedMemoryConnector", "kv_consumer", caches(None), tmp_path)
    params = {"remote_request_id": "r", "remote_block_ids": [1], "shm_path": str(victim)}
    params["kv_layout"] = consumer.transport.layout
    ok, _, _ = fetch_and_wait(consumer, KVFetch("c", params, remote_block_ids=[1], block_ids=[2]))
    assert not ok and victim.exists()


def test_an_unknown_connector_or_key_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_connector must be one of"):
        KVTransferConfig(kv_connector="LMCacheConnector")
    with pytest.raises(ConfigError, match="kv_role must be one of"):
        KVTransferConfig(kv_role="producer")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) kv_rank"):
        KVTransferConfig.from_dict({"kv_role": "kv_both", "kv_rank": 0})
    with pytest.raises(ConfigError, match="kv_hold_timeout_s must be a positive number"):
        KVTransferConfig(kv_hold_timeout_s=0)


def test_page_files_of_a_producer_that_is_gone_are_swept_at_start(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    stale = tmp_path / f"inferengine-kv-p{dead}-e0-cmpl-1"
    stale.write_bytes(b"\0" * 16)
    producer = worker("SharedMemoryConnector", "kv_producer", caches(1), tmp_path)
    live = Path(params_of(producer, "x", [1])["shm_path"])
    assert not stale.exists() and live.exists()
    worker("SharedMemoryConnector", "kv_consumer", caches(None), tmp_path)  # a second start
    assert live.exists()  # its producer is alive
    producer.close()
