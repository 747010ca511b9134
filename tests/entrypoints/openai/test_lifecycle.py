"""The server's life: a dead engine fails everything at once, then the server exits non-zero (for a
supervisor to restart it); SIGTERM drains, then exits."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.entrypoints.openai.server import SERVED_NAME, RemoteServer

LONG = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 400, "ignore_eos": True}
EXIT_AFTER_DEATH_S = 5.0


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    """Two servers, started side by side: each test below ends its server's life."""
    model = tiny_checkpoint("qwen3")
    pair = [RemoteServer(model, "--max-model-len", "512", "--drain-timeout", "60") for _ in "ab"]
    try:
        yield [s.wait_ready() for s in pair]
    finally:
        for s in pair:
            s.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_engine_death_fails_requests_then_the_server_exits(servers):
    server = servers[0]
    client = server.client()
    pid = server.stats()["engine_pid"]
    blocking: dict = {}

    def non_streaming() -> None:
        blocking["response"] = client.post("/v1/completions", json=LONG)

    thread = threading.Thread(target=non_streaming)
    thread.start()
    deadline = time.monotonic() + 30
    while server.stats()["num_requests_in_flight"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    with client.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert time.monotonic() - killed < 5
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["type"] == "engine_dead_error" and error["code"] == 503
    thread.join(10)
    assert blocking["response"].status_code == 503
    assert blocking["response"].json()["error"]["type"] == "engine_dead_error"
    # A server that would answer 503 forever exits instead, for systemd or Kubernetes to
    # restart it (measured from the kill, so the time to notice the death is in it too).
    assert server.proc.wait(EXIT_AFTER_DEATH_S + 10) == 1
    assert time.monotonic() - killed < EXIT_AFTER_DEATH_S
    log = server.output()
    assert (
        "engine core died (exit code -9 (SIGKILL)); shutting down the API server so a "
        "supervisor can restart it" in log
    )
    assert "Traceback" not in log


def test_sigterm_drains_then_exits(servers):
    server = servers[1]
    engine_pid = server.stats()["engine_pid"]
    client = server.client()
    body = LONG | {"max_tokens": 500, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        # The whole process group, as a terminal or `timeout` would: the engine must survive it.
        os.killpg(server.proc.pid, signal.SIGTERM)
        time.sleep(0.3)
        refused = httpx.post(f"{server.url}/v1/completions", json=LONG, headers=server.headers)
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert httpx.get(f"{server.url}/health").status_code == 503
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][6:])
    assert "usage" in last, last  # (an error event: the drain's 60 s ran out on a busy host)
    usage = last["usage"]
    assert usage["completion_tokens"] == 500  # the in-flight request finished whole
    assert server.proc.wait(30) == 0
    deadline = time.monotonic() + 10
    while _alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine_pid)
