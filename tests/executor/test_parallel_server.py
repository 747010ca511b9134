"""`inferengine serve` with tensor × pipeline parallelism on the CPU: greedy tokens equal
Transformers' through the server, and a killed worker process fails the engine (503 on /health,
an error for the running request) within 5 s, and the API server then exits 1 for a supervisor."""

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


def _children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    model = tiny_checkpoint("qwen3")
    s = RemoteServer(
        model,
        "--max-model-len",
        "512",
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
        "--max-num-batched-tokens",
        "40",
    )
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def test_tp2_pp2_server_greedy_equals_transformers(server, tiny_checkpoint):
    expected = _expected(str(tiny_checkpoint("qwen3")))

    def generate(args):
        prompt, n = args
        body = {"prompt_token_ids": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        with server.client() as c:
            return c.post("/v1/generate", json=body).json()["choices"][0]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(MAX_TOKENS)) as pool:
        got = list(pool.map(generate, zip(_prompts(), MAX_TOKENS, strict=True)))
    assert got == expected


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds workers through /proc")
def test_killing_a_worker_fails_the_server_engine_within_5_s(server):
    engine_pid = server.stats()["engine_pid"]
    workers = _children(engine_pid)
    assert len(workers) == 4, workers
    body = {"prompt": "Hello", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(workers[-1], signal.SIGKILL)
        killed = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed < 5
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["type"] == "engine_dead_error" and "worker" in error["message"]
    with contextlib.suppress(httpx.ConnectError):  # until it exits, /health says why
        assert httpx.get(f"{server.url}/health").status_code == 503
    # then it exits 1 so a supervisor restarts it (the engine core cannot come back by itself)
    assert server.proc.wait(timeout=10) == 1
    time.sleep(1.0)
    assert not [p for p in workers if Path(f"/proc/{p}").exists() and _alive(p)]


def _alive(pid: int) -> bool:
    """Not a zombie (a reaped-later child still has a /proc entry)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
