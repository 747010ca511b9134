"""Soak test: mixed traffic against `inferengine serve` under a supervisor, one engine kill midway.

    python benchmarks/soak.py --torch-threads 1                 # 10 minutes, default model, CPU
    python benchmarks/soak.py --duration-s 90 --torch-threads 1 --results-dir /tmp/soak  # a trial

(--torch-threads 1: on a small CPU shared with other work, two OpenMP threads spin-waiting on
each other made single requests 10 to 30 times slower in our trials.)

The server (`inferengine serve`, the default SmolLM2-135M GGUF unless --model) runs under a
supervisor loop that restarts it whenever it exits, as systemd's `Restart=always` would. A bounded
number of async clients send a mix of traffic to 127.0.0.1: streamed chat, non-streamed
completions, n > 1, JSON-schema response_format, forced tool calls, multi-turn agent sessions
(prompt_cache_key + prompt_cache_retention / cache_control), shared prefixes under
prompt_cache_key, streams the client drops part-way, and bad inputs (malformed JSON, lone
surrogates, unknown model, negative max_tokens, huge prompts and bodies) that must get a 4xx.
At --kill-at of the run the engine-core child of the API server is SIGKILLed: the server should
fail its in-flight requests and exit non-zero within --exit-within-s; the supervisor restarts it
and traffic resumes.

Timeline: the server starts (not timed); one request of each kind warms it; then --duration-s of
traffic. Each server run's RSS baseline is taken --warmup-s into its traffic, or later, once every
KV page has been written once (the CPU KV cache becomes resident as it fills), but before the kill
(first run), or for the restarted run by 2 x --warmup-s later or --min-after-restart-s before the
planned end, whichever comes later. After the kill and the restart,
another warm pass beside the resumed traffic, and at least --min-after-restart-s of traffic after
that run's baseline (the run is extended if the restart was slow).

Every request is classified: ok, rejected_4xx (a bad input refused, as it should be),
unexpected_4xx (a good input refused), cut_by_kill (failed while in flight in the kill window:
from the kill until the restarted server is healthy) or failed (5xx, connection errors and
timeouts outside that window, bad response bodies, bad inputs accepted). At the end /metrics and
/stats must show no request running or waiting and no KV page held by a request (prefix-cached
and leased free pages are free), and the server's RSS (API process + its children) must have
grown less than --max-rss-growth from a warm baseline, per server run. The script exits 1 if any
check fails and writes benchmarks/results/<UTC stamp>-soak-cpu/ (results.json: counts per class
and kind, checks, a few RSS samples; command, environment, and each server run's log tail).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

REPO = Path(__file__).resolve().parent.parent
NAME = "soak-cpu"
CLASSES = ("ok", "rejected_4xx", "unexpected_4xx", "cut_by_kill", "failed")
# Traffic kinds and their default weights (a client picks one per iteration).
KINDS = {
    "chat_stream": 24,
    "completion": 14,
    "n_choices": 8,
    "json_schema": 8,
    "tool_call": 8,
    "agent_session": 10,
    "cache_key": 8,
    "disconnect": 8,
    "bad_input": 12,
}
BAD_INPUTS = (
    "malformed_json",
    "lone_surrogate_chat",
    "lone_surrogate_completion",
    "unknown_model",
    "negative_max_tokens",
    "messages_not_a_list",
    "prompt_over_context",
    "body_over_limit",
)
DEFAULT_SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", "256MiB"]
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about caches.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
    "Why is the sky blue? Answer briefly.",
    "Give me a short tip for writing clean Python.",
    "Translate 'good morning' into Spanish and German.",
    "What does a compiler do?",
    "Name a famous bridge and the city it is in.",
    "Summarise the plot of Cinderella in one sentence.",
)
SHARED_PREFIX = (
    "You are a support assistant for a company that sells garden tools. Policies: refunds "
    "within 30 days with a receipt; exchanges within 60 days; tools with a lifetime warranty "
    "are replaced free of charge when they break in normal use; shipping is free over 50 "
    "dollars; orders ship within two working days; the shop is open Monday to Saturday, 9 to "
    "6. Be brief and polite, and never promise anything the policies do not say. "
) * 3
AGENT_SYSTEM = (
    "You are an agent that plans small errands. You can call tools; their results come back "
    "as user messages starting with 'Tool output:'. Think step by step and keep answers short."
)
SCHEMAS = (
    {
        "name": "person",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
    },
    {
        "name": "city",
        "schema": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "country": {"type": "string"},
                "population": {"type": "integer"},
            },
            "required": ["city", "country"],
        },
    },
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]


# ---- pure parts: accounting, metrics text, RSS, logs -----------------------------------------


@dataclass
class Record:
    """One request's outcome; classified at the end, when the kill window is known."""

    kind: str
    start: float  # seconds since the run's start
    end: float = 0.0
    ok: bool = False
    expect_4xx: bool = False
    status: int | None = None
    error: str | None = None  # "connect", "timeout", "read", "bad_response", "stream_error", ...
    detail: str = ""  # a short message for the failure table (no generated text)
    variant: str = ""  # which bad input
    completion_tokens: int = 0
    cached_tokens: int | None = None
    turn: int = 0


def classify(rec: Record, kill_window: tuple[float, float] | None) -> str:
    """One of CLASSES. A 4xx for a good input is never excused by the kill; any other failure
    of a request in flight at some moment of the kill window is."""
    if rec.ok:
        return "ok"
    is_4xx = rec.status is not None and 400 <= rec.status < 500
    if rec.expect_4xx and is_4xx:
        return "rejected_4xx"
    if is_4xx and not rec.expect_4xx:
        return "unexpected_4xx"
    if kill_window is not None and rec.start < kill_window[1] and rec.end > kill_window[0]:
        return "cut_by_kill"
    return "failed"


def tally(records: list[Record], kill_window: tuple[float, float] | None) -> dict[str, Any]:
    """Counts per class and per kind, bad inputs by variant and status, the failure table."""
    by_class: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    bad: dict[str, Counter[str]] = {}
    failures: Counter[tuple] = Counter()
    for rec in records:
        cls = classify(rec, kill_window)
        by_class[cls] += 1
        by_kind.setdefault(rec.kind, Counter())[cls] += 1
        if rec.expect_4xx:
            bad.setdefault(rec.variant, Counter())[str(rec.status or rec.error)] += 1
        if cls in ("failed", "unexpected_4xx", "cut_by_kill"):
            key = (cls, rec.kind, rec.variant, rec.status, rec.error, rec.detail[:160])
            failures[key] += 1
    table = [
        dict(zip(("class", "kind", "variant", "status", "error", "detail"), k, strict=True))
        | {"count": n}
        for k, n in failures.most_common(24)
    ]
    return {
        "total": len(records),
        "by_class": {c: by_class.get(c, 0) for c in CLASSES},
        "by_kind": {k: {c: n for c, n in v.items()} for k, v in sorted(by_kind.items())},
        "bad_inputs": {k: dict(v) for k, v in sorted(bad.items())},
        "failure_table": table,
    }


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name -> value, summed over label sets (`name{labels} value` lines)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def rss_growth(baseline: float | None, end: float | None) -> float | None:
    """Relative growth of RSS from `baseline` to `end` (0.05 = 5 percent), None if unknown."""
    if not baseline or end is None:
        return None
    return round(end / baseline - 1.0, 4)


def pick_samples(samples: list[dict], k: int = 12) -> list[dict]:
    """At most `k` samples, evenly spaced, first and last included."""
    if len(samples) <= k:
        return samples
    idx = sorted({round(i * (len(samples) - 1) / (k - 1)) for i in range(k)})
    return [samples[i] for i in idx]


def log_tail(text: str, lines: int = 60, max_line: int = 300, max_bytes: int = 8000) -> str:
    """The last `lines` lines of a log, each cut to `max_line` characters, at most `max_bytes`."""
    out = []
    for line in text.splitlines()[-lines:]:
        line = line.split("\r")[-1]  # a progress bar redrawn in place: its last state
        out.append(line if len(line) <= max_line else line[:max_line] + " [...]")
    body = "\n".join(out)
    while len(body.encode()) > max_bytes and "\n" in body:
        body = body.split("\n", 1)[1]
    return body + "\n"


def latency_summary(records: list[Record]) -> dict[str, dict[str, float]]:
    """Median and max seconds of the ok requests of each kind."""
    by_kind: dict[str, list[float]] = {}
    for rec in records:
        if rec.ok:
            by_kind.setdefault(rec.kind, []).append(rec.end - rec.start)
    return {
        k: {"n": len(v), "median_s": round(statistics.median(v), 3), "max_s": round(max(v), 3)}
        for k, v in sorted(by_kind.items())
    }


def check(passed: bool | None, value: Any, limit: Any = None, note: str = "") -> dict[str, Any]:
    """A check's record; passed None (could not be measured) counts as a failure."""
    out: dict[str, Any] = {"pass": bool(passed), "value": value}
    if limit is not None:
        out["limit"] = limit
    if note:
        out["note"] = note
    return out


# ---- the server under a supervisor -----------------------------------------------------------


def log(t0: float, message: str) -> None:
    """A progress line on stdout, stamped with the seconds since the run began."""
    print(f"[soak +{time.monotonic() - t0:7.1f}s] {message}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> tuple[int, int] | None:
    """(RSS of `pid`, RSS of all its descendants) in bytes, or None if it is gone."""
    try:
        proc = psutil.Process(pid)
        own = proc.memory_info().rss
        kids = 0
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                kids += child.memory_info().rss
        return own, kids
    except psutil.Error:
        return None


class Supervisor:
    """Runs the server, restarting it whenever it exits (after `restart_delay_s`), until
    `stop()`; at most `max_starts` starts. Each start's log goes to its own file."""

    def __init__(
        self, cmd: list[str], base_url: str, log_dir: Path, args: argparse.Namespace, t0: float
    ):
        self.cmd = cmd
        self.base_url = base_url
        self.log_dir = log_dir
        self.startup_timeout_s = args.startup_timeout_s
        self.max_starts = args.max_restarts + 1
        self.restart_delay_s = args.restart_delay_s
        self.t0 = t0
        self.env = dict(os.environ)
        if args.torch_threads:
            self.env["OMP_NUM_THREADS"] = str(args.torch_threads)
        self.runs: list[dict[str, Any]] = []
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = asyncio.Event()
        self.stopping = False
        # The current server's descendants as last seen: the engine core leads a process group
        # of its own, so after the server is gone these are how a survivor is found.
        self.children: list[psutil.Process] = []

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    @property
    def incarnation(self) -> int:
        return len(self.runs) - 1

    async def run(self) -> None:
        while not self.stopping and len(self.runs) < self.max_starts:
            i = len(self.runs)
            log_file = open(self.log_dir / f"server-{i}.log", "wb")  # noqa: SIM115
            run: dict[str, Any] = {"run": i, "started_s": self.now(), "ready_s": None}
            self.proc = await asyncio.create_subprocess_exec(
                *self.cmd,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
            run["pid"] = self.proc.pid
            self.runs.append(run)
            log(self.t0, f"server run {i} started (pid {self.proc.pid})")
            watcher = asyncio.create_task(self._wait_healthy(run, self.proc))
            code = await self.proc.wait()
            watcher.cancel()
            log_file.close()
            self.ready.clear()
            run.update(exit_code=code, exited_s=self.now())
            log(self.t0, f"server run {i} exited with code {code}")
            # Its children get a few seconds to notice and exit; the rest are killed.
            await asyncio.to_thread(psutil.wait_procs, self.children, timeout=5.0)
            survivors = self.kill_survivors()
            run["survivors_checked"] = True
            if survivors:
                run["survivors_killed"] = survivors
                log(self.t0, f"killed processes that outlived server run {i}: {survivors}")
            if not self.stopping:
                await asyncio.sleep(self.restart_delay_s)

    def note_children(self) -> None:
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(psutil.Error):
                self.children = psutil.Process(proc.pid).children(recursive=True)

    def kill_survivors(self) -> list[str]:
        """SIGKILL the last server's descendants that are still alive; their descriptions."""
        out = []
        for child in self.children:
            with contextlib.suppress(psutil.Error):
                if child.is_running():  # psutil checks the start time: no reused pid
                    cmd = " ".join(child.cmdline())[:80]
                    child.kill()
                    out.append(f"{child.pid}: {cmd}")
        self.children = []
        return out

    async def _wait_healthy(self, run: dict, proc: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        async with httpx.AsyncClient(base_url=self.base_url, timeout=5.0) as client:
            while time.monotonic() < deadline and proc.returncode is None:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get("/health")).status_code == 200:
                        run["ready_s"] = self.now()
                        self.note_children()
                        self.ready.set()
                        log(self.t0, f"server run {run['run']} is healthy")
                        return
                await asyncio.sleep(0.5)
        if proc.returncode is None:
            run["startup_timed_out"] = True
            self._kill_group(proc.pid, signal.SIGKILL)

    async def wait_ready(self, run: int, timeout: float) -> bool:
        """Whether start number `run` (or a later one) became healthy within `timeout` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(r["ready_s"] is not None for r in self.runs[run:]):
                return True
            if len(self.runs) >= self.max_starts and "exit_code" in self.runs[-1]:
                return False
            await asyncio.sleep(0.2)
        return False

    async def wait_exit(self, run: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.runs) > run and "exit_code" in self.runs[run]:
                return True
            await asyncio.sleep(0.05)
        return False

    @staticmethod
    def _kill_group(pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)  # start_new_session: the group is the server and its children

    def signal_current(self, sig: int, group: bool = False) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        if group:
            self._kill_group(proc.pid, sig)
        else:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM the current server, SIGKILL its group after `grace_s`; its exit code."""
        self.stopping = True
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            self.note_children()
            self.signal_current(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace_s)
            except TimeoutError:
                self.runs[-1]["killed_after_sigterm"] = True
                self.signal_current(signal.SIGKILL, group=True)
                await proc.wait()
        deadline = time.monotonic() + 10.0  # run() records the exit and reaps survivors
        while not self.runs[-1].get("survivors_checked") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return proc.returncode


def find_engine_core(api_pid: int, stats_pid: int | None) -> int | None:
    """The engine-core process: /stats' engine_pid when it is a child of the API server, else
    the spawned multiprocessing child that is not the resource tracker."""
    try:
        children = psutil.Process(api_pid).children(recursive=True)
    except psutil.Error:
        return None
    pids = {c.pid for c in children}
    if stats_pid in pids:
        return stats_pid
    for child in children:
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(child.cmdline())
            if "multiprocessing" in cmdline and "resource_tracker" not in cmdline:
                return child.pid
    return None


# ---- traffic --------------------------------------------------------------------------------


@dataclass
class Traffic:
    """Shared state of the clients."""

    base_url: str
    model: str
    args: argparse.Namespace
    t0: float
    supervisor: Supervisor
    records: list[Record] = field(default_factory=list)
    sessions: int = 0
    stopped: bool = False  # set when the traffic's time is up

    def now(self) -> float:
        return time.monotonic() - self.t0

    def done(self) -> bool:
        return self.stopped or len(self.records) >= self.args.max_requests


def _usage(body: dict, rec: Record) -> None:
    usage = body.get("usage") or {}
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")


def _error_detail(response: httpx.Response) -> str:
    try:
        err = response.json().get("error", {})
        return str(err.get("message") if isinstance(err, dict) else err)[:160]
    except (ValueError, AttributeError):
        return response.text[:160]


class BadResponse(Exception):
    """A 200 whose body is not what the request asked for."""


async def post_json(client: httpx.AsyncClient, path: str, body: dict, rec: Record) -> dict | None:
    """POST; the parsed body of a 200 (usage recorded), else None with the status noted."""
    response = await client.post(path, json=body)
    rec.status = response.status_code
    if response.status_code != 200:
        rec.detail = _error_detail(response)
        return None
    out = response.json()
    _usage(out, rec)
    return out


async def stream(
    client: httpx.AsyncClient, path: str, body: dict, rec: Record, stop_after: int | None = None
) -> list[dict] | None:
    """POST a streamed request; its chunks (None on an HTTP error). With `stop_after`, the
    client drops the connection after that many chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks: list[dict] = []
    async with client.stream("POST", path, json=body) as response:
        rec.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            rec.detail = _error_detail(response)
            return None
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]
                code = err.get("code") if isinstance(err, dict) else None
                rec.status = code if isinstance(code, int) else 500
                rec.error = "stream_error"
                rec.detail = str(err.get("message") if isinstance(err, dict) else err)[:160]
                return None
            chunks.append(chunk)
            if chunk.get("usage"):
                _usage(chunk, rec)
            if stop_after is not None and len(chunks) >= stop_after:
                rec.detail = f"dropped after {len(chunks)} chunks"
                return chunks  # leaving the block closes the connection mid-stream
        if not done:
            raise BadResponse("the stream ended without [DONE]")
    if not any(c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")):
        raise BadResponse("no chunk carried a finish_reason")
    return chunks


def _finish(body: dict) -> tuple[str | None, dict]:
    choice = body["choices"][0]
    return choice.get("finish_reason"), choice.get("message") or {}


async def do_chat_stream(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(16, 48),
    }
    rec.ok = await stream(c, "/v1/chat/completions", body, rec) is not None


async def do_completion(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    body = {"model": t.model, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(16, 32)}
    out = await post_json(c, "/v1/completions", body, rec)
    if out is not None:
        if not out["choices"] or not isinstance(out["choices"][0].get("text"), str):
            raise BadResponse("no text in the completion")
        rec.ok = True


async def do_n_choices(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    n = rng.choice((2, 3))
    body = {"model": t.model, "n": n, "max_tokens": 16, "temperature": 0.8}
    if rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", rng.choice(PROMPTS)
    else:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    out = await post_json(c, path, body, rec)
    if out is not None:
        if sorted(ch["index"] for ch in out["choices"]) != list(range(n)):
            raise BadResponse(f"asked for n={n}, got {len(out['choices'])} choices")
        rec.ok = True


async def do_json_schema(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    schema = rng.choice(SCHEMAS)
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": f"Describe a {schema['name']} as JSON."}],
        "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": schema},
    }
    out = await post_json(c, "/v1/chat/completions", body, rec)
    if out is None:
        return
    finish, message = _finish(out)
    if finish == "stop":
        try:
            value = json.loads(message.get("content") or "")
        except ValueError as e:
            raise BadResponse(f"content is not JSON ({e})") from None
        missing = [k for k in schema["schema"]["required"] if k not in value]
        if missing:
            raise BadResponse(f"JSON lacks required keys {missing}")
    rec.ok = True


async def do_tool_call(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    tool = rng.choice(TOOLS)
    name = tool["function"]["name"]
    question = "What is the weather in Oslo?" if name == "get_weather" else "What is 17 + 25?"
    body = {
        "model": t.model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 40,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": name}},
    }
    out = await post_json(c, "/v1/chat/completions", body, rec)
    if out is None:
        return
    finish, message = _finish(out)
    if finish == "tool_calls":
        calls = message.get("tool_calls") or []
        if not calls or calls[0]["function"]["name"] != name:
            raise BadResponse(f"forced {name}, got {[x['function']['name'] for x in calls]}")
        try:
            json.loads(calls[0]["function"]["arguments"])
        except ValueError:
            raise BadResponse("tool arguments are not JSON") from None
    elif finish != "length":
        raise BadResponse(f"forced tool call finished with {finish!r}")
    rec.ok = True


async def do_cache_key(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    key = f"soak-shared-{rng.randrange(4)}"
    body = {
        "model": t.model,
        "prompt": f"{SHARED_PREFIX}\nCustomer: {rng.choice(PROMPTS)}\nAssistant:",
        "max_tokens": 16,
        "prompt_cache_key": key,
        "prompt_cache_retention": rng.choice(("in_memory", "120s")),
    }
    out = await post_json(c, "/v1/completions", body, rec)
    rec.ok = out is not None


async def do_disconnect(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    body = {
        "model": t.model,
        "messages": [
            {
                "role": "user",
                "content": "Tell me a long story about "
                + rng.choice(("a dragon", "the sea", "a robot", "a lighthouse")),
            }
        ],
        "max_tokens": 200,
        "ignore_eos": True,
    }
    chunks = await stream(c, "/v1/chat/completions", body, rec, stop_after=rng.randint(1, 8))
    rec.ok = chunks is not None


def bad_request(variant: str, model: str) -> tuple[str, bytes]:
    """(path, raw body) of one bad input."""

    def dump(x: dict) -> bytes:
        return json.dumps(x).encode()

    chat = "/v1/chat/completions"
    if variant == "malformed_json":
        return chat, b'{"model": "x", "messages": [{"role": "user", "content": "hi"'
    if variant == "lone_surrogate_chat":  # valid JSON text, but not valid Unicode
        return (
            chat,
            b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 4}',
        )
    if variant == "lone_surrogate_completion":
        return "/v1/completions", b'{"prompt": "x \\udfff", "max_tokens": 4}'
    if variant == "unknown_model":
        msgs = [{"role": "user", "content": "hi"}]
        return chat, dump({"model": "no-such-model", "messages": msgs, "max_tokens": 4})
    if variant == "negative_max_tokens":
        return "/v1/completions", dump({"model": model, "prompt": "hi", "max_tokens": -5})
    if variant == "messages_not_a_list":
        return chat, dump({"model": model, "messages": "hello", "max_tokens": 4})
    if variant == "prompt_over_context":  # ~1 MB of text: far past max_model_len
        return "/v1/completions", dump({"model": model, "prompt": "word " * 200_000})
    if variant == "body_over_limit":  # past the default 8 MiB --max-request-body-bytes
        msgs = [{"role": "user", "content": "x" * (9 << 20)}]
        return chat, dump({"model": model, "messages": msgs, "max_tokens": 4})
    raise ValueError(variant)


async def do_bad_input(t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record):
    rec.expect_4xx = True
    rec.variant = rng.choice(BAD_INPUTS)
    path, raw = bad_request(rec.variant, t.model)
    response = await c.post(path, content=raw, headers={"Content-Type": "application/json"})
    rec.status = response.status_code
    rec.detail = _error_detail(response) if response.status_code >= 500 else ""
    if response.status_code < 400:
        rec.error, rec.detail = "accepted", "a bad input was accepted"


async def do_agent_session(
    t: Traffic, c: httpx.AsyncClient, rng: random.Random, rec: Record
) -> Record:
    """Two to four turns of one session under prompt_cache_key, each turn a record of its own
    (`rec` is the first); the last turn's record."""
    t.sessions += 1
    key = f"soak-agent-{t.sessions}-{rng.randrange(1 << 30)}"
    system: dict[str, Any] = {"role": "system", "content": AGENT_SYSTEM + " " + SHARED_PREFIX}
    lease: dict[str, Any] = {"prompt_cache_key": key}
    if rng.random() < 0.5:
        lease["prompt_cache_retention"] = "60s"
    else:  # Anthropic's mark on the system message
        system["content"] = [
            {
                "type": "text",
                "text": system["content"],
                "cache_control": {"type": "ephemeral", "ttl": "5m"},
            }
        ]
    messages = [
        system,
        {
            "role": "user",
            "content": "Plan a trip to buy " + rng.choice(("bread", "a bike", "paint", "stamps")),
        },
    ]
    for turn in range(1, rng.randint(2, 4) + 1):
        if turn > 1:
            if t.done():
                break
            await asyncio.sleep(rng.uniform(0.2, 1.5))  # the agent runs its tool
            rec = Record("agent_session", t.now())
            t.records.append(rec)
        rec.turn = turn
        body = {"model": t.model, "messages": messages, "max_tokens": 24, **lease}
        reply: list[str] = []

        async def ask(rec: Record = rec, body: dict = body, reply: list = reply) -> None:
            out = await post_json(c, "/v1/chat/completions", body, rec)
            if out is not None:
                reply.append(_finish(out)[1].get("content") or "")
                rec.ok = True

        await guarded(rec, t, ask())
        if not rec.ok:
            break
        messages = [
            *messages,
            {"role": "assistant", "content": reply[0]},
            {"role": "user", "content": f"Tool output: {rng.randrange(10**6)}. Next?"},
        ]
    return rec


async def guarded(rec: Record, t: Traffic, coro) -> None:
    """Run one request with the overall timeout; note its outcome in `rec`."""
    try:
        await asyncio.wait_for(coro, t.args.request_timeout_s)
    except TimeoutError:
        rec.error, rec.detail = "timeout", f"no answer within {t.args.request_timeout_s} s"
    except httpx.ConnectError as e:
        rec.error, rec.detail = "connect", type(e).__name__
    except httpx.TimeoutException as e:
        rec.error, rec.detail = "timeout", type(e).__name__
    except httpx.HTTPError as e:
        rec.error, rec.detail = "http", f"{type(e).__name__}: {e}"[:160]
    except BadResponse as e:
        rec.error, rec.detail = "bad_response", str(e)[:160]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        rec.error, rec.detail = "bad_response", f"{type(e).__name__}: {e}"[:160]
    finally:
        rec.end = t.now()
    if rec.error is not None:
        rec.ok = False


HANDLERS = {
    "chat_stream": do_chat_stream,
    "completion": do_completion,
    "n_choices": do_n_choices,
    "json_schema": do_json_schema,
    "tool_call": do_tool_call,
    "agent_session": do_agent_session,
    "cache_key": do_cache_key,
    "disconnect": do_disconnect,
    "bad_input": do_bad_input,
}


def make_client(t: Traffic) -> httpx.AsyncClient:
    timeout = httpx.Timeout(t.args.request_timeout_s, connect=5.0)
    return httpx.AsyncClient(base_url=t.base_url, timeout=timeout)


async def run_one(t: Traffic, c: httpx.AsyncClient, rng: random.Random, kind: str) -> Record:
    rec = Record(kind, t.now())
    t.records.append(rec)
    if kind == "agent_session":
        return await do_agent_session(t, c, rng, rec)
    await guarded(rec, t, HANDLERS[kind](t, c, rng, rec))
    return rec


async def client_loop(t: Traffic, index: int) -> None:
    rng = random.Random(t.args.seed * 1000 + index)
    kinds = list(KINDS)
    weights = [KINDS[k] for k in kinds]
    incarnation = t.supervisor.incarnation
    c = make_client(t)
    try:
        while not t.done():
            if t.supervisor.incarnation != incarnation:  # a new server: no stale connections
                incarnation = t.supervisor.incarnation
                await c.aclose()
                c = make_client(t)
            rec = await run_one(t, c, rng, rng.choices(kinds, weights)[0])
            if rec.error in ("connect", "http") or (rec.status or 0) >= 500:
                # The server is failing or down: back off, and wait while it restarts.
                await asyncio.sleep(0.5)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(t.supervisor.ready.wait(), 60.0)
    finally:
        await c.aclose()


async def warm_pass(t: Traffic) -> None:
    """One request of every kind, one after another (grammars compiled, caches filled)."""
    rng = random.Random(t.args.seed - 1)
    async with make_client(t) as c:
        for kind in KINDS:
            if t.done():
                return
            rec = await run_one(t, c, rng, kind)
            outcome = "ok" if rec.ok else f"{rec.status or rec.error} {rec.detail[:60]}"
            log(t.t0, f"  warm pass: {kind} {rec.end - rec.start:.1f} s ({outcome})")


async def progress(t: Traffic, every_s: float = 60.0) -> None:
    """A line of counts every `every_s` seconds."""
    while True:
        await asyncio.sleep(every_s)
        ok = sum(r.ok for r in t.records)
        log(t.t0, f"{len(t.records)} requests, {ok} ok (kill window not yet applied)")


# ---- the run ---------------------------------------------------------------------------------


async def scrape(base_url: str) -> tuple[dict[str, float] | None, dict | None]:
    """(/metrics samples, /stats body), either None where unavailable."""
    metrics = stats = None
    async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as c:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await c.get("/metrics")
            if r.status_code == 200:
                metrics = parse_prometheus(r.text)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await c.get("/stats")
            if r.status_code == 200:
                stats = r.json()
    return metrics, stats


def _idle(metrics: dict[str, float] | None, stats: dict | None) -> bool:
    if metrics is None or stats is None:
        return False
    return (
        metrics.get("inferengine:num_requests_running") == 0
        and metrics.get("inferengine:num_requests_waiting") == 0
        and metrics.get("inferengine:kv_cache_usage_perc") == 0
        and stats.get("kv_pages_used") == 0
        and stats.get("num_requests_in_flight") == 0
    )


class RSSSampler:
    """Samples the server tree's RSS every `interval` s while a server is ready."""

    def __init__(self, sup: Supervisor, interval: float):
        self.sup = sup
        self.interval = interval
        self.samples: list[dict[str, Any]] = []

    def sample(self, label: str = "") -> dict[str, Any] | None:
        if not self.sup.ready.is_set() or self.sup.proc is None:
            return None
        self.sup.note_children()
        rss = tree_rss(self.sup.proc.pid)
        if rss is None:
            return None
        s = {
            "t_s": self.sup.now(),
            "run": self.sup.incarnation,
            "api_mib": round(rss[0] / 2**20, 1),
            "children_mib": round(rss[1] / 2**20, 1),
            "total_mib": round(sum(rss) / 2**20, 1),
        }
        if label:
            s["label"] = label
        self.samples.append(s)
        return s

    async def loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)


async def wait_until(t_mono: float) -> None:
    delay = t_mono - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


def new_kv_tokens(metrics: dict[str, float]) -> float:
    """Tokens written into KV pages so far: prompt tokens not found in the prefix cache, plus
    generated ones."""
    prompt = metrics.get("inferengine:prompt_tokens_total", 0.0)
    hits = metrics.get("inferengine:prefix_cache_hits_total", 0.0)
    return prompt - hits + metrics.get("inferengine:generation_tokens_total", 0.0)


async def take_baseline(
    t: Traffic, sampler: RSSSampler, not_before: float, not_after: float, wait_for=()
) -> dict | None:
    """The RSS baseline of the current server: from `not_before` on, once the tasks in
    `wait_for` are done and every KV page has been written once, but by `not_after` at the
    latest. The CPU KV cache is an anonymous map whose pages become resident as they are
    first written, and free pages are handed out oldest first, so the cache has been through
    every page once the tokens written reach its size; before that, RSS grows without a leak."""
    await wait_until(not_before)
    if wait_for:
        await asyncio.wait(wait_for, timeout=max(0.0, not_after - time.monotonic()))
    written = capacity = None
    while True:
        metrics, stats = await scrape(t.base_url)
        if metrics is not None and stats is not None:
            written = max(0.0, new_kv_tokens(metrics))  # hits may be counted before prompts
            capacity = stats.get("kv_pages_total", 0) * t.args.block_size
            if written >= capacity:
                break
        if time.monotonic() >= not_after:
            break
        await asyncio.sleep(2.0)
    sample = sampler.sample("baseline")
    if sample is not None:
        sample["kv_tokens_written"] = written
        sample["kv_tokens_capacity"] = capacity
        sample["kv_written_once"] = written is not None and written >= (capacity or 0)
    return sample


async def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    # SIGTERM stops the run as Ctrl-C does: the servers are stopped on the way out.
    task = asyncio.current_task()
    assert task is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    port = args.port or free_port()
    base_url = f"http://127.0.0.1:{port}"
    exe = shutil.which("inferengine") or "inferengine"
    cmd = [
        exe,
        "serve",
        *([args.model] if args.model else []),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--uvicorn-log-level",
        "warning",
        *args.server_args,
    ]
    t0 = time.monotonic()
    sup = Supervisor(cmd, base_url, workdir, args, t0)
    sup_task = asyncio.create_task(sup.run())
    sup_task.add_done_callback(
        lambda task: (
            task.cancelled()
            or task.exception() is None
            or log(t0, f"the supervisor failed: {task.exception()!r}")
        )
    )
    result: dict[str, Any] = {"server_command": " ".join(cmd[1:])}
    checks: dict[str, dict[str, Any]] = {}
    sampler = RSSSampler(sup, args.rss_interval_s)
    sampler_task = progress_task = None
    clients: list[asyncio.Task] = []
    warm_tasks: list[asyncio.Task] = []
    try:
        if not await sup.wait_ready(0, args.startup_timeout_s):
            raise RuntimeError(f"the server did not become healthy: {sup.runs}")
        async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as c:
            model = (await c.get("/v1/models")).json()["data"][0]["id"]
        t = Traffic(base_url, model, args, t0, sup)
        result["model"] = model
        sampler_task = asyncio.create_task(sampler.loop())
        progress_task = asyncio.create_task(progress(t))
        # One request of each kind first (grammars compiled, caches filled), then the clock.
        log(t0, f"serving {model} at {base_url}; warm pass (one request of each kind)")
        await warm_pass(t)
        result["warm_pass_s"] = round(sup.now() - sup.runs[0]["ready_s"], 3)
        log(
            t0,
            f"warm pass done in {result['warm_pass_s']} s; {args.duration_s:g} s of traffic "
            f"from {args.clients} clients",
        )
        start = time.monotonic()
        deadline = start + args.duration_s
        result["traffic_started_s"] = sup.now()
        clients = [asyncio.create_task(client_loop(t, i)) for i in range(args.clients)]
        kill_mono = start + args.kill_at * args.duration_s if args.kill_at is not None else None
        last = (kill_mono or deadline) - 1
        baselines = [await take_baseline(t, sampler, min(start + args.warmup_s, last), last)]
        log(t0, f"RSS baseline: {baselines[0]}")
        ends: list[dict | None] = []
        kill: dict[str, Any] = {}
        kill_window = None
        if kill_mono is not None:
            await wait_until(kill_mono)
            ends.append(sampler.sample("before kill"))
            log(t0, f"{len(t.records)} requests so far; killing the engine core")
            kill, kill_window = await kill_engine(t, sup, base_url, args)
            log(t0, f"kill: { ({k: v for k, v in kill.items() if k != 'checks'}) }")
            checks.update(kill.pop("checks"))
            if kill.get("restart_ready_mono") is not None:
                # The clients resume by themselves; a warm pass beside them, the baseline of
                # this run --warmup-s after it is healthy, and at least --min-after-restart-s
                # of traffic after that.
                warm_tasks.append(asyncio.create_task(warm_pass(t)))
                at = kill["restart_ready_mono"] + args.warmup_s
                last = max(at + 2 * args.warmup_s, deadline - args.min_after_restart_s)
                baselines.append(await take_baseline(t, sampler, at, last, warm_tasks))
                log(t0, f"RSS baseline of the restarted server: {baselines[-1]}")
                deadline = max(deadline, time.monotonic() + args.min_after_restart_s)
        await wait_until(deadline)
        t.stopped = True
        traffic_end = sup.now()
        log(t0, f"traffic stops ({len(t.records)} requests); waiting for the clients")
        await asyncio.wait(clients + warm_tasks, timeout=args.request_timeout_s + 15)
        stuck = sum(not c.done() for c in clients + warm_tasks)
        # No request left: nothing running or waiting, no KV page held by a request.
        metrics = stats = None
        settle = time.monotonic() + args.settle_s
        while True:
            metrics, stats = await scrape(base_url)
            if _idle(metrics, stats) or time.monotonic() > settle:
                break
            await asyncio.sleep(1.0)
        ends.append(sampler.sample("end"))
        m = metrics or {}
        end_state = {
            "num_requests_running": m.get("inferengine:num_requests_running"),
            "num_requests_waiting": m.get("inferengine:num_requests_waiting"),
            "kv_cache_usage_perc": m.get("inferengine:kv_cache_usage_perc"),
            "kv_leased_blocks": m.get("inferengine:kv_leased_blocks"),
            "kv_sessions": m.get("inferengine:kv_sessions"),
            "num_preemptions": m.get("inferengine:num_preemptions_total"),
            "prefix_cache_hits": m.get("inferengine:prefix_cache_hits_total"),
            "prefix_cache_queries": m.get("inferengine:prefix_cache_queries_total"),
        }
        for key in (
            "kv_pages_total",
            "kv_pages_used",
            "kv_pages_free",
            "kv_pages_cached",
            "num_requests_in_flight",
            "prefix_cache_hit_rate",
        ):
            end_state[f"stats.{key}"] = (stats or {}).get(key)
        result["end_state"] = end_state
        checks["no_request_or_kv_page_held_at_end"] = check(
            _idle(metrics, stats),
            {
                k: end_state[k]
                for k in (
                    "num_requests_running",
                    "num_requests_waiting",
                    "kv_cache_usage_perc",
                    "stats.kv_pages_used",
                    "stats.num_requests_in_flight",
                )
            },
            note="kv_cache_usage_perc and kv_pages_used count pages with a reference; "
            "prefix-cached and leased free pages are free",
        )
        checks["clients_finished"] = check(stuck == 0, stuck, 0)
        # RSS: per server run, warm baseline against that run's last sample.
        segments = []
        for i, base in enumerate(baselines):
            end = ends[i] if i < len(ends) else None
            growth = rss_growth(base and base["total_mib"], end and end["total_mib"])
            segments.append({"run": i, "baseline": base, "end": end, "growth": growth})
            note = "" if growth is not None else "no baseline or end sample"
            if base is not None and not base.get("kv_written_once"):
                note = "baseline taken before every KV page was written once: growth may "
                note += "include KV pages becoming resident"
            checks[f"rss_growth_run{i}"] = check(
                growth is not None and growth < args.max_rss_growth,
                growth,
                args.max_rss_growth,
                note=note,
            )
        result["rss"] = {
            "segments": segments,
            "max_total_mib": max((s["total_mib"] for s in sampler.samples), default=None),
            "samples": pick_samples(sampler.samples),
            "num_samples": len(sampler.samples),
        }
        # Clean stop: SIGTERM, drain, exit 0.
        stop_code = await sup.stop(args.stop_grace_s)
        checks["clean_stop_exit_0"] = check(stop_code == 0, stop_code, 0)
        records = t.records
        counts = tally(records, kill_window)
        result["counts"] = counts
        by_class = counts["by_class"]
        checks["no_failed_requests"] = check(by_class["failed"] == 0, by_class["failed"], 0)
        checks["no_unexpected_4xx"] = check(
            by_class["unexpected_4xx"] == 0, by_class["unexpected_4xx"], 0
        )
        no_ok = [
            k
            for k in KINDS
            if not counts["by_kind"].get(k, {}).get("rejected_4xx" if k == "bad_input" else "ok")
        ]
        checks["every_kind_succeeded"] = check(not no_ok, no_ok or "all", note="kinds with none")
        if kill_window is not None:
            after = [r for r in records if r.ok and r.start >= kill_window[1]]
            checks["traffic_resumed_after_restart"] = check(bool(after), len(after), ">= 1")
        survivors = [r["run"] for r in sup.runs if r.get("survivors_killed")]
        checks["no_process_outlived_its_server"] = check(not survivors, survivors, [])
        result["kill"] = kill
        result["traffic_s"] = round(traffic_end - result["traffic_started_s"], 3)
        result["latency_ok"] = latency_summary(records)
        later = [r for r in records if r.kind == "agent_session" and r.turn > 1 and r.ok]
        result["agent_sessions"] = {
            "sessions": t.sessions,
            "later_turns_ok": len(later),
            "later_turns_with_cached_tokens": sum(bool(r.cached_tokens) for r in later),
        }
        ok = [r for r in records if r.ok]
        result["completion_tokens_ok"] = sum(r.completion_tokens for r in ok)
        timed = [r for r in ok if result["traffic_started_s"] <= r.start < traffic_end]
        result["ok_requests_per_s"] = round(len(timed) / max(result["traffic_s"], 1e-9), 3)
    finally:
        for task in [*clients, *warm_tasks, sampler_task, progress_task]:
            if task is not None:
                task.cancel()
        if not sup.stopping or (sup.proc and sup.proc.returncode is None):
            await sup.stop(args.stop_grace_s)
        sup_task.cancel()
        await asyncio.gather(sup_task, *clients, *warm_tasks, return_exceptions=True)
        sup.kill_survivors()
    result["server_runs"] = sup.runs
    result["checks"] = checks
    result["passed"] = all(c["pass"] for c in checks.values())
    return result


async def kill_engine(t: Traffic, sup: Supervisor, base_url: str, args: argparse.Namespace):
    """SIGKILL the engine core; watch the server exit and the supervisor restart it. Returns
    (the kill's record with its checks, the kill window in run seconds)."""
    run = sup.incarnation
    api_pid = sup.runs[run]["pid"]
    _, stats = await scrape(base_url)
    core = find_engine_core(api_pid, (stats or {}).get("engine_pid"))
    checks: dict[str, dict[str, Any]] = {}
    kill: dict[str, Any] = {"api_pid": api_pid, "engine_core_pid": core, "checks": checks}
    checks["engine_core_found"] = check(core is not None, core)
    if core is None:
        return kill, None
    kill_mono = time.monotonic()
    os.kill(core, signal.SIGKILL)
    kill["killed_s"] = sup.now()
    t_kill = kill_mono - t.t0
    exited = await sup.wait_exit(run, args.exit_wait_s)
    if exited:
        r = sup.runs[run]
        kill["server_exit_code"] = r["exit_code"]
        kill["server_exit_after_s"] = round(r["exited_s"] - t_kill, 3)
    else:  # still up (answering 503?): stop it so that the run can go on
        kill["server_exit_code"] = None
        kill["forced_stop"] = True
        sup.signal_current(signal.SIGTERM)
        if not await sup.wait_exit(run, 10.0):
            sup.signal_current(signal.SIGKILL, group=True)
            await sup.wait_exit(run, 10.0)
    after = kill.get("server_exit_after_s")
    checks["server_exited_nonzero_after_engine_kill"] = check(
        exited and kill["server_exit_code"] not in (0, None) and after <= args.exit_within_s,
        {"exit_code": kill["server_exit_code"], "after_s": after},
        f"non-zero within {args.exit_within_s} s",
        note="" if exited else f"still running {args.exit_wait_s} s after the kill; stopped",
    )
    restarted = await sup.wait_ready(run + 1, args.startup_timeout_s)
    ready_s = sup.runs[-1]["ready_s"] if restarted else None
    kill["restart_ready_s"] = ready_s
    kill["restart_ready_after_s"] = round(ready_s - t_kill, 3) if restarted else None
    kill["restart_ready_mono"] = t.t0 + ready_s if restarted else None
    checks["server_restarted"] = check(restarted, kill["restart_ready_after_s"])
    window_end = ready_s if restarted else float("inf")
    # Requests in flight at the kill should end soon after it (failed, not hung).
    in_flight = [r for r in t.records if r.start <= t_kill and (r.end == 0 or r.end > t_kill)]
    lags = [(r.end if r.end else t.now()) - t_kill for r in in_flight]
    kill["in_flight_at_kill"] = len(in_flight)
    worst = round(max(lags), 3) if lags else 0.0
    limit = args.exit_within_s + 2
    checks["in_flight_at_kill_ended"] = check(worst <= limit, worst, f"<= {limit} s")
    kill["window_s"] = [round(t_kill, 3), window_end if restarted else None]
    return kill, (t_kill, window_end)


def mark_unexpected_exits(result: dict[str, Any]) -> None:
    """A server exit that was neither the kill's nor the final stop's."""
    kill_run = None
    if result.get("kill", {}).get("killed_s") is not None:
        kill_run = next(
            (
                r["run"]
                for r in result["server_runs"]
                if r["started_s"] <= result["kill"]["killed_s"] <= r.get("exited_s", float("inf"))
            ),
            None,
        )
    last = len(result["server_runs"]) - 1
    for r in result["server_runs"]:
        r["unexpected_exit"] = "exit_code" in r and r["run"] not in (kill_run, last)


def write_logs(folder: Path, workdir: Path) -> None:
    for path in sorted(workdir.glob("server-*.log")):
        text = path.read_bytes().decode("utf-8", errors="replace")
        (folder / f"{path.stem}.tail.log").write_text(log_tail(text), encoding="utf-8")


def print_summary(result: dict[str, Any], folder: Path | None) -> None:
    counts = result.get("counts", {})
    print(f"soak: {result.get('traffic_s')} s of traffic, {counts.get('total')} requests")
    print(f"  by class: {counts.get('by_class')}")
    for kind, by in counts.get("by_kind", {}).items():
        print(f"  {kind:14s} {by}")
    if counts.get("bad_inputs"):
        print(f"  bad inputs (status): {counts['bad_inputs']}")
    for row in counts.get("failure_table", [])[:10]:
        print(f"  ! {row}")
    kill = {k: v for k, v in result.get("kill", {}).items() if k != "restart_ready_mono"}
    if kill:
        print(f"  kill: {kill}")
    for seg in result.get("rss", {}).get("segments", []):
        b, e = seg["baseline"], seg["end"]
        print(
            f"  rss run {seg['run']}: {b and b['total_mib']} -> {e and e['total_mib']} MiB "
            f"(growth {seg['growth']})"
        )
    for name, c in result.get("checks", {}).items():
        print(
            f"  [{'PASS' if c['pass'] else 'FAIL'}] {name}: {c['value']}"
            + (f" (limit {c['limit']})" if "limit" in c else "")
        )
    print(
        f"soak: {'PASSED' if result.get('passed') else 'FAILED'}"
        + (f"; results in {folder}" if folder else "")
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--model", default=None, help="model to serve (default: the server's)")
    p.add_argument(
        "--server-arg",
        dest="server_args",
        action="append",
        default=None,
        help=f"extra `inferengine serve` argument, repeatable "
        f"(default: {' '.join(DEFAULT_SERVER_ARGS)})",
    )
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the server (default: the engine's choice); 1 avoids OpenMP "
        "spin-wait thrash on a small, busy CPU",
    )
    p.add_argument(
        "--kill-at",
        type=float,
        default=0.5,
        help="kill the engine core at this fraction of the run",
    )
    p.add_argument("--no-kill", dest="kill_at", action="store_const", const=None)
    p.add_argument(
        "--exit-within-s",
        type=float,
        default=5.0,
        help="the API server must exit this soon after the engine is killed",
    )
    p.add_argument(
        "--exit-wait-s",
        type=float,
        default=30.0,
        help="after this long, a server that has not exited is stopped",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="traffic seconds before each RSS baseline (default: min(60, run/8))",
    )
    p.add_argument(
        "--min-after-restart-s",
        type=float,
        default=30.0,
        help="traffic after the restarted server's RSS baseline (extends the run if needed)",
    )
    p.add_argument("--max-rss-growth", type=float, default=0.10)
    p.add_argument("--rss-interval-s", type=float, default=5.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--max-requests", type=int, default=100_000, help="a bound on the count")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--restart-delay-s", type=float, default=1.0, help="systemd's RestartSec")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument(
        "--settle-s",
        type=float,
        default=15.0,
        help="at the end, how long to wait for the server to go idle",
    )
    p.add_argument("--stop-grace-s", type=float, default=40.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--no-results", action="store_true", help="print only, write no folder")
    args = p.parse_args(argv)
    if args.server_args is None:
        args.server_args = list(DEFAULT_SERVER_ARGS)
    args.block_size = 16  # the server's default; --server-arg --block-size N changes it
    for i, arg in enumerate(args.server_args):
        if arg.startswith("--block-size="):
            args.block_size = int(arg.split("=", 1)[1])
        elif arg == "--block-size" and i + 1 < len(args.server_args):
            args.block_size = int(args.server_args[i + 1])
    if args.warmup_s is None:
        args.warmup_s = min(60.0, args.duration_s / 8)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="inferengine-soak-"))
    started = time.time()
    try:
        result = asyncio.run(soak(args, workdir))
    except RuntimeError as e:
        result = {"error": str(e), "passed": False, "checks": {}}
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("soak: interrupted; the server was stopped, no results written")
        shutil.rmtree(workdir, ignore_errors=True)
        return 130
    result["wall_s"] = round(time.time() - started, 1)
    result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if "server_runs" in result:
        mark_unexpected_exits(result)
        unexpected = [r["run"] for r in result["server_runs"] if r["unexpected_exit"]]
        result["checks"]["no_unexpected_server_exits"] = check(not unexpected, unexpected, [])
        result["passed"] = all(c["pass"] for c in result["checks"].values())
    result.get("kill", {}).pop("restart_ready_mono", None)
    folder = None
    if not args.no_results:
        folder = write_result_folder(NAME, result, root=args.results_dir)
        write_logs(folder, workdir)
    print_summary(result, folder)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0 if result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
