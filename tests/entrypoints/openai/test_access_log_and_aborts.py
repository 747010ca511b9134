"""Two operator's views of a running server: uvicorn's access log (off unless
`--enable-access-log`), and `inferengine:request_success_total{finished_reason="abort"}`, which
counts the requests whose clients left mid-stream (as vLLM counts them)."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.entrypoints.openai.server import SERVED_NAME, RemoteServer

ACCESS_LINE = '"GET /v1/models HTTP/1.1" 200'
HEALTH_LINE = '"GET /health HTTP/1.1"'
STREAM = {
    "model": SERVED_NAME,
    "prompt": "Hello",
    "max_tokens": 400,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    """Both at uvicorn's log level info, where its access lines would show: the default, and
    one with the access log on. Started side by side."""
    common = ("--max-model-len", "512", "--uvicorn-log-level", "info")
    pair = [
        RemoteServer(tiny_checkpoint("qwen3"), *common),
        RemoteServer(tiny_checkpoint("qwen3"), *common, "--enable-access-log"),
    ]
    try:
        yield [s.wait_ready() for s in pair]
    finally:
        for s in pair:
            s.stop()


def test_access_log_is_off_by_default_and_on_with_the_flag(servers):
    default, logged = servers
    for server in servers:
        with server.client() as client:
            assert client.get("/v1/models").status_code == 200
    deadline = time.monotonic() + 10
    while ACCESS_LINE not in logged.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ACCESS_LINE in logged.output()
    assert HEALTH_LINE in logged.output()  # wait_ready() polled /health until 200
    # the default: not a line per request, nor for the start-up's /health polls
    assert ACCESS_LINE not in default.output() and HEALTH_LINE not in default.output()
    assert "Application startup complete" in default.output()  # uvicorn's info lines remain


def abort_count(server: RemoteServer) -> float:
    return finished_count(server, "abort")


def finished_count(server: RemoteServer, reason: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    pattern = r"^inferengine:request_success_total\{([^}]*)\} (\S+)$"
    for labels, value in re.findall(pattern, text, re.MULTILINE):
        if f'finished_reason="{reason}"' in labels:
            return float(value)
    return 0.0


def test_client_disconnects_count_as_aborts(servers):
    server = servers[0]
    aborts, lengths = abort_count(server), finished_count(server, "length")
    left = 3
    for _ in range(left):
        with server.client() as client, client.stream("POST", "/v1/completions", json=STREAM) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        # leaving the `with` closes the connection mid-stream
    deadline = time.monotonic() + 20
    while abort_count(server) < aborts + left and time.monotonic() < deadline:
        time.sleep(0.1)
    with server.client() as client:  # a request that ends by itself is no abort
        body = STREAM | {"stream": False, "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
    time.sleep(0.3)
    assert abort_count(server) == aborts + left
    assert finished_count(server, "length") == lengths + 1
    assert server.stats()["num_requests_in_flight"] == 0
