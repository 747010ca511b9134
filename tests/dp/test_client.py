"""`DPClient` over in-process fake replicas: routing from KV events, failover, stats."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from inferengine.config import ParallelConfig
from inferengine.core.block_pool import KV_CPU_STORED, KV_STORED
from inferengine.core.engine_io import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
)
from inferengine.core.hashing import hash_prompt_blocks
from inferengine.dp.client import DPClient
from inferengine.dp.replica import ReplicaFrame, decode_requests, encode_frame
from inferengine.errors import EngineDeadError
from inferengine.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(10, 27))  # 17 tokens: 4 blocks a cache could serve


class FakeReplica:
    """A `ReplicaHandle` whose outputs the test pushes; `kill()` breaks its stream."""

    def __init__(self, replica_id: int):
        self.replica_id = replica_id
        self.incarnation = 0
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.frames: asyncio.Queue = asyncio.Queue()
        self.up = asyncio.Event()
        self.up.set()
        self.restarted = 0

    async def ready(self, timeout: float) -> dict[str, Any]:
        await asyncio.wait_for(self.up.wait(), timeout)
        return {
            "incarnation": str(self.incarnation),
            "pid": 100 + self.replica_id,
            "num_blocks": 10,
            "max_model_len": 64 + self.replica_id,
        }

    async def _done(self) -> None:
        return None

    def add_requests(self, payload: bytes):
        self.added += [r.request_id for r in decode_requests(payload)]
        return self._done()

    def abort_requests(self, request_ids: list[str]):
        self.aborted += request_ids
        return self._done()

    async def utility(self, method: str, args: list, timeout: float) -> Any:
        if method == "get_stats":
            return msgspec.to_builtins(
                SchedulerStats(num_running=1, num_blocks=9, prefix_cache_queries=10)
            )
        return True

    async def outputs(self):
        while True:
            item = await self.frames.get()
            if isinstance(item, BaseException):
                raise item
            yield [item]

    def push(self, outputs: list[EngineCoreOutput], events=(), stats=None) -> None:
        frame = ReplicaFrame(EngineCoreOutputs(outputs, stats), list(events))
        self.frames.put_nowait(encode_frame(frame))

    def kill(self, comes_back: bool = True) -> None:
        self.frames.put_nowait(RuntimeError("the actor died"))
        self.incarnation += 1
        if not comes_back:
            self.up.clear()

    def restart(self) -> None:
        self.restarted += 1
        self.incarnation += 1

    def shutdown(self) -> None:
        pass


def request(request_id: str, prompt: list[int] = PROMPT, key: str | None = None):
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=4), cache_key=key)


def make_client(n: int = 2, **router_flags: Any) -> tuple[DPClient, list[FakeReplica]]:
    config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BS, enable_prefix_caching=True),
        parallel_config=ParallelConfig(data_parallel_size=n, **router_flags),
    )
    fakes = [FakeReplica(i) for i in range(n)]
    return DPClient(config, fakes), fakes


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def run(coro) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_ready_info_and_routing_from_kv_events():
    async def go():
        client, (a, b) = make_client()
        info = await client.wait_until_ready()
        assert info["num_blocks"] == 19 and info["max_model_len"] == 64
        assert info["pid"] == 100 and info["data_parallel_size"] == 2
        # replica 1 reports the prompt's first three blocks stored
        stored = [(KV_STORED, h) for h in hash_prompt_blocks(PROMPT, BS)[:3]]
        b.push([], stored)
        await settle()
        await client.add_request(request("x"))
        await client.add_request(request("y", list(range(50, 60))))
        assert (a.added, b.added) == (["y"], ["x"])
        # outputs pass through, the finished request leaves the router
        b.push([EngineCoreOutput("x", [7], finish_reason=0)], stats=SchedulerStats(num_running=1))
        out = await client.get_output()
        assert [o.request_id for o in out.outputs] == ["x"]
        assert out.scheduler_stats is not None and out.scheduler_stats.num_running == 1
        assert client.router.replicas[1].served == 1 and "x" not in client.requests
        await client.abort_requests(["y", "unknown"])
        assert a.aborted == ["y"] and client.router.replicas[0].in_flight == 0
        client.shutdown()

    run(go())


def test_a_dead_replica_s_queued_requests_go_elsewhere_and_streaming_ones_fail():
    async def go():
        client, (a, b) = make_client()
        failed: list[tuple[list[str], BaseException]] = []
        client.on_failed = lambda ids, e: failed.append((ids, e))
        await client.wait_until_ready()
        for rid, tokens in (("s", [1] * 9), ("q", [2] * 9), ("o", [3] * 9)):
            await client.add_request(request(rid, tokens))
        assert (a.added, b.added) == (["s", "o"], ["q"])
        a.push([EngineCoreOutput("s", [5])])  # "s" has started streaming, "o" has not
        await client.get_output()
        a.kill()
        await settle()
        assert failed and failed[0][0] == ["s"] and isinstance(failed[0][1], EngineDeadError)
        assert b.added == ["q", "o"]  # rerouted
        assert client.router.rerouted == 1 and client.failed_streams == 1
        assert client.slots[0].restarts == 1
        # Ray's new incarnation is up: the replica serves again, from an empty index
        await settle()
        assert client.slots[0].status == "up" and client.router.replicas[0].up
        # a late output of "o" from replica 0 (Ray delivered its add again) is dropped there
        a.push([EngineCoreOutput("o", [9])])
        b.push([EngineCoreOutput("o", [4], finish_reason=0)])
        out = await client.get_output()
        assert [(o.request_id, o.new_token_ids) for o in out.outputs] == [("o", [4])]
        assert a.aborted == ["o"]
        assert not client.is_dead
        client.shutdown()

    run(go())


def test_a_replica_whose_stream_broke_but_lives_on_is_restarted():
    async def go():
        client, (a, _) = make_client()
        await client.wait_until_ready()
        a.frames.put_nowait(RuntimeError("network blip"))  # same incarnation answers ready()
        for _ in range(50):
            await asyncio.sleep(0.05)
            if client.slots[0].status == "up" and a.restarted:
                break
        assert a.restarted == 1 and client.slots[0].status == "up"
        client.shutdown()

    run(go())


def test_requests_wait_while_every_replica_restarts():
    async def go():
        client, (a, b) = make_client()
        await client.wait_until_ready()
        a.kill(comes_back=False)
        b.kill(comes_back=False)
        await settle()
        await client.add_request(request("p"))
        assert [t.request.request_id for t in client.parked] == ["p"]
        b.up.set()
        for _ in range(20):
            await settle()
        assert b.added == ["p"] and not client.parked
        await client.add_request(request("p2"))
        await client.abort_requests(["p2"])
        client.shutdown()

    run(go())


def test_the_client_is_dead_when_no_replica_comes_back(monkeypatch):
    monkeypatch.setattr("inferengine.dp.client.READY_RETRIES", 1)
    monkeypatch.setattr("inferengine.envs.engine_startup_timeout_s", lambda: 0.2)

    async def go():
        client, (a, b) = make_client()
        await client.wait_until_ready()
        a.kill(comes_back=False)
        b.kill(comes_back=False)
        await asyncio.sleep(1.5)
        assert [s.status for s in client.slots] == ["dead", "dead"]
        with pytest.raises(EngineDeadError):
            await client.get_output()
        with pytest.raises(EngineDeadError):
            await client.add_request(request("late"))

    run(go())


def test_stats_sum_replicas_and_keep_counts_of_restarted_ones():
    async def go():
        client, (a, b) = make_client()
        await client.wait_until_ready()
        a.push([], stats=SchedulerStats(num_blocks=10, kv_cache_usage=0.5, prefix_cache_hits=8))
        b.push([], stats=SchedulerStats(num_blocks=30, kv_cache_usage=0.1, prefix_cache_hits=2))
        await settle()
        total = client.scheduler_stats()
        assert total.num_blocks == 40 and total.prefix_cache_hits == 10
        assert total.kv_cache_usage == pytest.approx((5 + 3) / 40)
        a.kill()
        await settle()
        total = client.scheduler_stats()
        assert total.prefix_cache_hits == 10 and total.num_blocks == 30
        raw = await client.call_utility("get_stats")
        assert raw["prefix_cache_queries"] == 20 and raw["prefix_cache_hits"] == 8
        assert await client.call_utility("reset_prefix_cache") is True
        rows = client.replica_stats()
        assert [r["pid"] for r in rows] == [100, 101] and rows[0]["restarts"] == 1
        client.shutdown()

    run(go())


def test_router_flags_and_cpu_tier_events_reach_the_router():
    async def go():
        client, (a, b) = make_client(router_inflight_weight=0.0, router_cpu_hit_weight=0.5)
        rc = client.router.config
        assert (rc.block_size, rc.load_cost_tokens, rc.cpu_hit_cost) == (BS, 0.0, 0.5)
        await client.wait_until_ready()
        h = hash_prompt_blocks(PROMPT, BS)
        a.push([], [(KV_STORED, h[0])])
        b.push([], [(KV_CPU_STORED, x) for x in h])
        await settle()
        # replica 0: 13 tokens to compute; replica 1: 1, and 16 loaded from its CPU tier at 0.5
        await client.add_request(request("x"))
        assert (a.added, b.added) == ([], ["x"])
        rows = client.replica_stats()
        assert [(r["cached_blocks_indexed"], r["cpu_cached_blocks_indexed"]) for r in rows] == [
            (1, 0),
            (0, 4),
        ]
        client.shutdown()

    run(go())
