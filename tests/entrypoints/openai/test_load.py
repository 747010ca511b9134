"""Load on the CPU: many concurrent streams finish whole; clients that leave free their pages."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.entrypoints.openai.server import SERVED_NAME

NUM_STREAMS = 200
NUM_DISCONNECTS = 50


def _async_client(server) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=NUM_STREAMS + 10, max_keepalive_connections=0)
    return httpx.AsyncClient(
        base_url=server.url, headers=server.headers, limits=limits, timeout=300
    )


def wait_idle(server, timeout: float = 10.0) -> dict:
    """/stats once nothing runs, waits or holds a KV page (fails after `timeout` s)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = server.stats()
        idle = (
            stats["num_requests_running"] == 0
            and stats["num_requests_waiting"] == 0
            and stats["num_requests_in_flight"] == 0
            and stats["kv_pages_used"] == 0
        )
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _finished(server) -> dict[str, float]:
    """inferengine:request_success_total by finish reason."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    return {
        s.labels["finished_reason"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "inferengine:request_success_total"
    }


async def _stream_one(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, str]:
    body = {
        "model": SERVED_NAME,
        "prompt": f"Request number {i}: the quick brown fox",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage, finish, done = None, None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                finish = choice["finish_reason"] or finish
            usage = event.get("usage") or usage
    assert done and usage is not None
    return usage["completion_tokens"], finish


def test_200_concurrent_streams_complete(tiny_server):
    max_tokens = 16

    async def run() -> list[tuple[int, str]]:
        async with _async_client(tiny_server) as client:
            return await asyncio.gather(
                *(_stream_one(client, i, max_tokens) for i in range(NUM_STREAMS))
            )

    results = asyncio.run(run())
    assert results == [(max_tokens, "length")] * NUM_STREAMS
    stats = wait_idle(tiny_server)
    assert stats["kv_pages_used"] == 0 and stats["num_requests_running"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnected_clients_free_everything(tiny_server, stream):
    """Clients that leave mid-request are aborted: no request runs on and no page stays used;
    each counts as finished by "abort"."""
    finished_before = _finished(tiny_server)
    body = {"model": SERVED_NAME, "max_tokens": 400, "ignore_eos": True, "stream": stream}

    async def leave_early(client: httpx.AsyncClient, i: int) -> None:
        payload = body | {"prompt": f"Client {i} says hello"}
        if stream:
            async with client.stream("POST", "/v1/completions", json=payload) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks >= 2:
                        return  # leaving the block closes the connection mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=payload, timeout=1.0)

    async def run() -> None:
        async with _async_client(tiny_server) as client:
            await asyncio.gather(*(leave_early(client, i) for i in range(NUM_DISCONNECTS)))

    asyncio.run(run())
    stats = wait_idle(tiny_server, timeout=10.0)
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
    assert stats["kv_pages_used"] == 0, stats
    # Aborted, not finished: 50 x 400 tokens would take far longer than this test did.
    finished = _finished(tiny_server)
    assert finished.pop("abort") == finished_before.pop("abort", 0.0) + NUM_DISCONNECTS
    assert finished == finished_before
