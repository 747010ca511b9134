"""`inferengine serve --distributed-executor-backend ray --ray-address ...` on a local Ray cluster
of two nodes: greedy tokens equal Transformers' through the server with the two ranks on
different nodes, and a killed rank fails the running request within 5 s, after which the API
server exits 1 for a supervisor."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.openai.server import RemoteServer
from tests.executor.test_parallel_engine import MAX_TOKENS, _expected, _prompts
from tests.executor.test_parallel_server import _alive, _children
from tests.executor.test_ray_executor import start_two_node_cluster

pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # CI runs these too (the README's command selects no marker)


@pytest.fixture(scope="module")
def cluster():
    cluster = start_two_node_cluster()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def server(cluster, tiny_checkpoint):
    s = RemoteServer(
        tiny_checkpoint("qwen3"),
        "--max-model-len",
        "512",
        "--tensor-parallel-size",
        "2",
        "--distributed-executor-backend",
        "ray",
        "--ray-address",
        cluster.address,
        "--max-num-batched-tokens",
        "40",
    )
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def _rank_pids(cluster) -> list[int]:
    """The rank actors' processes: children of the cluster's raylets, by their title."""
    raylets = [p.process.pid for n in cluster.list_all_nodes() for p in n.all_processes["raylet"]]
    pids = [pid for raylet in raylets for pid in _children(raylet)]
    return [p for p in pids if b"RayRankWorker" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_tp2_ray_server_greedy_equals_transformers(server, tiny_checkpoint):
    expected = _expected(str(tiny_checkpoint("qwen3")))

    def generate(args):
        prompt, n = args
        body = {"prompt_token_ids": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        with server.client() as c:
            return c.post("/v1/generate", json=body).json()["choices"][0]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(MAX_TOKENS)) as pool:
        got = list(pool.map(generate, zip(_prompts(), MAX_TOKENS, strict=True)))
    assert got == expected
    server.log.seek(0)
    log = server.log.read()
    assert "Ray placed 2 ranks on 2 node(s)" in log and "rank links: 0-1 network" in log


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds ranks through /proc")
def test_killing_a_rank_fails_the_server_engine_within_5_s(server, cluster):
    ranks = _rank_pids(cluster)
    assert len(ranks) == 2, ranks
    body = {"prompt": "Hello", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(ranks[-1], signal.SIGKILL)
        killed = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed < 5
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["type"] == "engine_dead_error" and "Ray actor" in error["message"]
    with contextlib.suppress(httpx.ConnectError):  # until it exits, /health says why
        assert httpx.get(f"{server.url}/health").status_code == 503
    assert server.proc.wait(timeout=10) == 1
    deadline = time.monotonic() + 10  # Ray ends the other rank with the engine's job
    while any(Path(f"/proc/{p}").exists() and _alive(p) for p in ranks):
        assert time.monotonic() < deadline, "a rank outlived its engine"
        time.sleep(0.2)
