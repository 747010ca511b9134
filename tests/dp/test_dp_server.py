"""`serve --data-parallel-size 2` end to end on the CPU: a local Ray, two tiny replicas.

Both replicas serve; a shared-prefix workload keeps a single engine's cached tokens and its
greedy tokens; sessions stick; `/stats` and `/metrics` show the replicas; and killing a replica
mid-load loses no request that had not started streaming, while the endpoint stays up and Ray
restarts the replica.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.entrypoints.openai.server import RemoteServer

pytest.importorskip("ray")

MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 2  # per replica: the rest wait there, so a kill finds requests not yet started
# An odd number of groups, interleaved: round-robin over two replicas would send each group's
# requests to both, keeping half of one engine's cached tokens.
PREFIX_LEN, GROUPS, PER_GROUP = 128, 7, 3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp_server(tiny_checkpoint):
    server = RemoteServer(
        tiny_checkpoint("qwen3"),
        "--data-parallel-size",
        "2",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(MAX_NUM_SEQS),
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def shared_prefix_prompts() -> list[list[int]]:
    """GROUPS prefixes of PREFIX_LEN tokens, each asked PER_GROUP times with its own tail;
    the groups interleave, as independent users would."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(5, 300) for _ in range(PREFIX_LEN)] for _ in range(GROUPS)]
    return [
        prefix + [rng.randrange(5, 300) for _ in range(rng.randrange(3, 20))]
        for _ in range(PER_GROUP)
        for prefix in prefixes
    ]


def generate(server: RemoteServer, prompt: list[int], **fields) -> dict:
    body = {"prompt_token_ids": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with server.client() as client:
        response = client.post("/v1/generate", json=body | fields)
    assert response.status_code == 200, response.text
    return response.json()


def test_replicas_keep_one_engine_s_cached_and_greedy_tokens(dp_server, tiny_checkpoint):
    from inferengine import LLM, SamplingParams

    prompts = shared_prefix_prompts()
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda p: generate(dp_server, p), prompts))
    tokens = [r["choices"][0]["token_ids"] for r in replies]
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)

    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert tokens == [list(o.outputs[0].token_ids) for o in outputs]
    single = sum(o.num_cached_tokens for o in outputs)
    assert single >= GROUPS * (PER_GROUP - 1) * PREFIX_LEN  # every later request reuses its prefix
    assert cached >= 0.9 * single, (cached, single)

    stats = dp_server.stats()
    served = [r["requests_served"] for r in stats["replicas"]]
    assert all(n > 0 for n in served) and sum(served) >= len(prompts), served
    assert stats["router"]["decisions"]["prefix"] >= GROUPS * (PER_GROUP - 1) * 0.9


def test_a_session_stays_on_one_replica(dp_server):
    before = dp_server.stats()["router"]["decisions"]["session"]
    rng = random.Random(1)
    for _ in range(3):
        prompt = [rng.randrange(5, 300) for _ in range(20)]
        generate(dp_server, prompt, prompt_cache_key="conversation-1", max_tokens=2)
    assert dp_server.stats()["router"]["decisions"]["session"] == before + 2


def test_stats_and_metrics_show_each_replica(dp_server):
    stats = dp_server.stats()
    assert stats["data_parallel_size"] == 2
    rows = stats["replicas"]
    assert [r["id"] for r in rows] == [0, 1]
    for row in rows:
        assert row["status"] == "up" and row["pid"] > 0
        assert 0.0 <= row["kv_cache_usage"] <= 1.0 and 0.0 <= row["prefix_cache_hit_rate"] <= 1.0
    text = httpx.get(f"{dp_server.url}/metrics", timeout=10).text
    for replica in ("0", "1"):
        assert f'inferengine:replica_up{{model_name="tiny",replica="{replica}"}} 1.0' in text
        assert (
            f'inferengine:replica_requests_served_total{{model_name="tiny",replica="{replica}"}}'
            in text
        )
    assert 'inferengine:router_decisions_total{model_name="tiny",reason="prefix"}' in text
    # the engine-wide families are the sums over the replicas
    assert "inferengine:prefix_cache_hits_total" in text


class StreamRecord:
    def __init__(self) -> None:
        self.chunks = 0  # token chunks received
        self.chunks_at_kill = 0
        self.chunks_before_error: int | None = None  # SSE is ordered: what came before it
        self.finished = False
        self.error: dict | None = None


def stream(server: RemoteServer, prompt: list[int], record: StreamRecord) -> None:
    body = {
        "prompt_token_ids": prompt,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with server.client() as client, client.stream("POST", "/v1/generate", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                record.error, record.chunks_before_error = event["error"], record.chunks
                continue
            for choice in event["choices"]:
                record.chunks += bool(choice["token_ids"])
                record.finished |= choice["finish_reason"] is not None


def test_killing_a_replica_loses_no_request_that_had_not_streamed(dp_server):
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 300) for _ in range(24)] for _ in range(12)]
    records = [StreamRecord() for _ in prompts]
    threads = [
        threading.Thread(target=stream, args=(dp_server, p, rec))
        for p, rec in zip(prompts, records, strict=True)
    ]
    for t in threads:
        t.start()
    # Each replica runs two at a time (a request takes 400 steps): the victim is one with
    # requests streaming and at least two waiting, so that one still waits when the kill lands
    # (the /stats row is a few milliseconds old by then).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rows = dp_server.stats()["replicas"]
        ready = [r for r in rows if 0 < r["requests_streaming"] <= r["requests_in_flight"] - 2]
        if ready:
            break
        time.sleep(0.02)
    victim = ready[0]
    for rec in records:
        rec.chunks_at_kill = rec.chunks
    os.kill(victim["pid"], signal.SIGKILL)
    assert httpx.get(f"{dp_server.url}/health", timeout=10).status_code == 200
    for t in threads:
        t.join(60)

    for rec in records:
        # Each request completed, or it had streamed tokens (before the error event, in
        # order) when its replica died: none that had not started is lost.
        assert rec.finished or (rec.error is not None and rec.chunks_before_error), vars(rec)
        if rec.error is not None:
            assert rec.error["type"] == "engine_dead_error", rec.error
            assert "engine replica" in rec.error["message"], rec.error
    # those the clients had seen nothing of when the replica died (most of them waited)
    assert sum(rec.finished and not rec.chunks_at_kill for rec in records) >= 2
    # the endpoint stays up and serves; Ray restarts the replica
    assert generate(dp_server, prompts[0], max_tokens=2)["choices"][0]["token_ids"]
    stats = dp_server.stats()
    assert stats["router"]["rerouted_requests"] >= 1
    failed = sum(rec.error is not None for rec in records)
    assert stats["router"]["failed_streams"] == failed >= 1
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        row = dp_server.stats()["replicas"][victim["id"]]
        if row["status"] == "up":
            break
        time.sleep(0.5)
    assert row["status"] == "up" and row["restarts"] == 1 and row["pid"] != victim["pid"]
    # one replica's death is no engine death: the server never stopped to be restarted
    assert dp_server.proc.poll() is None
    assert "shutting down the API server" not in dp_server.output()
