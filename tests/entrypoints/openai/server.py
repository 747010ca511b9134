"""`RemoteServer`: `inferengine serve` in a subprocess on a free local port, for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

SERVED_NAME = "tiny"
API_KEY = "sk-test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """Starts at once; `wait_ready()` blocks until `/health` says 200 (noting any 503 before)."""

    def __init__(self, model: Path, *args: str, api_key: str | None = API_KEY):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="inferengine-serve-", suffix=".log")  # noqa: SIM115 (closed in stop())
        cmd = [
            sys.executable,
            "-m",
            "inferengine.entrypoints.cli.main",
            "serve",
            str(model),
            "--port",
            str(self.port),
            "--served-model-name",
            SERVED_NAME,
            "--kv-cache-memory",
            "64MiB",
            "--uvicorn-log-level",
            "warning",
            "--disable-log-requests",
            *args,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.saw_503_before_ready = False

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> RemoteServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=2).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                return self
            if status == 503:
                self.saw_503_before_ready = True
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout} s:\n{self.output()}")

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60, **kwargs)

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", headers=self.headers, timeout=10).json()

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.log.close()
        return self.proc.returncode


def sse_events(lines) -> list:
    """The JSON payloads (and the final "[DONE]") of an SSE stream, given its lines."""
    import json

    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
