"""End to end ([24]): `inferengine serve` as kv_producer and as kv_consumer and `inferengine router`
over them, on the CPU: greedy tokens equal to one engine's, streamed and not, the pages passed
(no fallback); then the producer killed mid-load, and every request still answered in full."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from inferengine.core.block_pool import KV_STORED
from inferengine.core.hashing import hash_prompt_blocks
from tests.entrypoints.openai.server import RemoteServer, free_port, sse_events
from tests.entrypoints.router.test_router_proxy import metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [
    f"Request {i}: the quick brown fox jumps over the lazy dog, and then it runs far away into "
    f"the green hills beyond the river where nobody can find it again, number {i}."
    for i in range(6)
]


def _role(role: str) -> str:
    return json.dumps({"kv_role": role, "kv_connector": "SharedMemoryConnector"})


class RemoteRouter:
    """`inferengine router` in a subprocess on a free port."""

    def __init__(self, prefill: str, decode: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log")  # noqa: SIM115 (closed in stop())
        cmd = [sys.executable, "-m", "inferengine.entrypoints.cli.main", "router"]
        cmd += ["--prefill", prefill, "--decode", decode, "--port", self.url.rsplit(":", 1)[1]]
        cmd += ["--health-check-interval", "0.2", "--uvicorn-log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> RemoteRouter:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited:\n{Path(self.log.name).read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"router not ready:\n{Path(self.log.name).read_text()}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="module")
def servers(tiny_checkpoint):
    model = tiny_checkpoint("qwen3")
    producer = RemoteServer(model, "--kv-transfer-config", _role("kv_producer"), api_key=None)
    consumer = RemoteServer(model, "--kv-transfer-config", _role("kv_consumer"), api_key=None)
    router = None
    try:
        producer.wait_ready()
        consumer.wait_ready()
        router = RemoteRouter(producer.url, consumer.url).wait_ready()
        yield producer, consumer, router
    finally:
        if router is not None:
            router.stop()
        producer.stop()
        consumer.stop()


def complete(url: str, prompt: str, stream: bool, max_tokens: int = 12) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["choices"][0]["text"]
    events = sse_events(r.text.splitlines())
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"])


def test_greedy_tokens_equal_one_engines_streamed_and_not(servers):
    producer, consumer, router = servers
    # One engine's answers: the producer, asked directly (no kv_transfer_params: a plain engine).
    expected = [complete(producer.url, p, stream=False) for p in PROMPTS]
    # Each prompt reaches the consumer once, so that each takes its pages from the producer.
    got = [complete(router.url, p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)]
    assert got == expected
    scrape = httpx.get(f"{router.url}/metrics").text
    assert metric(scrape, "router_kv_transfers_total") == len(PROMPTS)  # all passed pages
    for reason in ("prefill_failed", "no_kv_params", "decode_retried"):
        assert metric(scrape, "router_fallbacks_total", reason=reason) == 0
    # The producer's KV events hold each prompt's blocks, hashed as the router hashes them.
    events = httpx.get(f"{producer.url}/kv_events", params={"since": 0}).json()
    assert events["snapshot"] and events["block_size"] == 16
    held = {bytes.fromhex(h) for kind, h in events["events"] if kind == KV_STORED}
    for prompt in PROMPTS:
        ids = httpx.post(f"{producer.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert set(hash_prompt_blocks(ids, 16)) <= held
    # and the consumer used them (kv_transfer/: its own counters)
    scrape = httpx.get(f"{consumer.url}/metrics").text
    assert metric(scrape, "kv_transfer_received_tokens_total") > 0
    assert metric(scrape, "kv_transfer_fallback_total") == 0


def test_killing_the_producer_mid_load_loses_no_request(servers):
    producer, consumer, router = servers
    expected = {p: complete(consumer.url, p, stream=False, max_tokens=16) for p in PROMPTS[:4]}
    jobs = [(p, stream) for p in PROMPTS[:4] for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(complete, router.url, p, s, 16) for p, s in jobs]
        time.sleep(0.3)  # some prefilled, some not yet
        os.killpg(producer.proc.pid, signal.SIGKILL)
        answers = [f.result(timeout=240) for f in futures]
    assert answers == [expected[p] for p, _ in jobs]
    scrape = httpx.get(f"{router.url}/metrics").text
    assert metric(scrape, "router_errors_total", reason="stream_broken") == 0
    # the router notices the dead engine at its next health poll (--health-check-interval)
    deadline = time.monotonic() + 10
    while httpx.get(f"{router.url}/health").json()["prefill_up"] != 0:
        assert time.monotonic() < deadline, "the router never noticed the producer's death"
        time.sleep(0.2)
