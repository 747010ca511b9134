"""Systems under test: `--system` specs, presets, and launching, health-checking and stopping servers.

A spec is one of
    NAME=COMMAND              a shell command that starts a server; `{port}` in it becomes a free
                              port (else the port is read from `--port N`, else 8000)
    NAME=url:URL              a server that is already running (nothing is started or stopped)
    NAME=preset:PRESET [ARGS] a preset command (`inferengine`, `vllm`, `transformers`), ARGS
                              appended to its server flags
    PRESET                    the same as PRESET=preset:PRESET
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from inferengine.bench.vllm_client import VLLM_PYTHONPATH
from inferengine.errors import ConfigError, InferEngineError

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
DEFAULT_PORT = 8000
KILL_WAIT_S = 5.0  # how long stop() waits for a SIGKILLed group to vanish


class ServerError(InferEngineError):
    """A server did not come up or died."""


@dataclass
class SystemSpec:
    name: str
    command: str | None = None  # None: already running at base_url
    base_url: str | None = None
    model: str | None = None  # the `model` to send; None: the first one /v1/models lists
    extra_body: dict = field(default_factory=dict)  # merged into every request
    send_ignore_eos: bool = True  # False for servers that reject the field
    preset: str | None = None
    mode: str = "paired"  # paired, alone (as a user runs it) or traced (`bench paired` sets it)


def preset_spec(
    name: str, preset: str, extra: str, model_dir: str | None, served: str
) -> SystemSpec:
    """A preset's command line for the model folder `model_dir`."""
    if not model_dir:
        raise ConfigError(f"preset {preset!r} needs --model-dir (a folder with config.json)")
    model = shlex.quote(model_dir)
    # A shell runs the command: a newline left in `extra` (a multi-line string in a script) would
    # end the command there and run the rest as another.
    extra = " ".join(extra.split())
    tail = f" {extra}" if extra else ""
    if preset == "inferengine":
        command = (
            f"{shlex.quote(sys.executable)} -m inferengine.entrypoints.cli.main serve {model} "
            f"--host 127.0.0.1 --port {{port}} --served-model-name {shlex.quote(served)}{tail}"
        )
        return SystemSpec(name, command, preset=preset)
    if preset == "vllm":
        if not Path(VLLM_PYTHONPATH, "vllm").is_dir():
            raise ConfigError(
                f"preset vllm runs vLLM from {VLLM_PYTHONPATH}, which is not there; unpack it "
                "first (/work/shared/peers/README.md), or use NAME=url:http://127.0.0.1:8001"
            )
        command = (
            "HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 "
            f"PYTHONPATH={VLLM_PYTHONPATH} python3 -m vllm.entrypoints.cli.main serve {model} "
            f"--host 127.0.0.1 --port {{port}} --served-model-name {shlex.quote(served)}{tail}"
        )
        return SystemSpec(name, command, preset=preset)
    if preset == "transformers":
        # It rejects `ignore_eos`; an impossible EOS id makes it generate max_tokens instead.
        command = (
            "HF_HUB_OFFLINE=1 HF_HUB_DISABLE_UPDATE_CHECK=1 "
            f"{shlex.quote(sys.executable)} -m transformers.cli.transformers serve {model} "
            f"--continuous-batching --dtype bfloat16 --device cuda --host 127.0.0.1 "
            f"--port {{port}}{tail}"
        )
        return SystemSpec(
            name,
            command,
            model=model_dir,
            extra_body={"generation_config": '{"eos_token_id": -1}'},
            send_ignore_eos=False,
            preset=preset,
        )
    raise ConfigError(f"unknown preset {preset!r}; presets are inferengine, vllm, transformers")


def parse_system(text: str, model_dir: str | None, served: str) -> SystemSpec:
    """One `--system` value (see the module docstring)."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep:
        rest = f"preset:{name}"
    if not _NAME_RE.match(name):
        raise ConfigError(f"--system {text!r}: write NAME=COMMAND, NAME=url:URL or a preset name")
    rest = rest.strip()
    if rest.startswith("url:"):
        return SystemSpec(name, base_url=rest[4:].rstrip("/"))
    if rest.startswith("preset:"):
        preset, _, extra = rest[7:].strip().partition(" ")
        return preset_spec(name, preset, extra.strip(), model_dir, served)
    if not rest:
        raise ConfigError(f"--system {text!r} has no command")
    return SystemSpec(name, command=rest)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_port(spec: SystemSpec) -> tuple[str | None, str]:
    """The command with `{port}` filled in, and the base URL the server will answer on."""
    if spec.command is None:
        return None, str(spec.base_url)
    if "{port}" in spec.command:
        port = free_port()
        return spec.command.replace("{port}", str(port)), f"http://127.0.0.1:{port}"
    tokens = shlex.split(spec.command)
    port = DEFAULT_PORT
    for i, token in enumerate(tokens):
        if token == "--port" and i + 1 < len(tokens):
            port = int(tokens[i + 1])
        elif token.startswith("--port="):
            port = int(token.split("=", 1)[1])
    return spec.command, f"http://127.0.0.1:{port}"


class ServerProcess:
    """A server command in its own process group, its output going to a log file."""

    def __init__(self, command: str, log_path: Path, env: dict[str, str] | None = None) -> None:
        self.command = command
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (open for the server's lifetime)
        self.launched_at = time.perf_counter()
        self.killed: list[int] = []  # processes still alive `timeout_s` after SIGTERM
        self.proc = subprocess.Popen(
            command,
            shell=True,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the server's group, then wait for its whole session: a process that left
        the group (our engine core does, so that a terminal's Ctrl-C reaches only the API
        process) is still the server's and must be gone, its CPU and GPU memory free, before
        the next system starts. SIGKILL to whatever is left after `timeout_s`."""
        sid = self.proc.pid  # the session leader, thanks to start_new_session
        _signal_group(sid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and _session_alive(sid, self.proc):
            time.sleep(0.1)
        if _session_alive(sid, self.proc):
            self.killed = _session_pids(sid) or [sid]
            _signal_group(sid, signal.SIGKILL)
            for pid in self.killed:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # SIGKILL lands asynchronously: wait until the session is really gone (its GPU
            # memory free for the next system), not just signalled.
            deadline = time.monotonic() + KILL_WAIT_S
            while time.monotonic() < deadline and _session_alive(sid, self.proc):
                time.sleep(0.02)
        self.proc.wait()
        self._log.close()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def _session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (zombies that no one reaps do not count); [] where
    there is no /proc."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _session_alive(sid: int, proc: subprocess.Popen) -> bool:
    """Whether any process of the server's session still runs."""
    proc.poll()  # reap the leader so that it does not linger as a zombie
    if not Path("/proc").is_dir():  # not Linux: ask the kernel about the group, zombies included
        try:
            os.killpg(sid, 0)
        except ProcessLookupError:
            return False
        return True
    return bool(_session_pids(sid))


def health_ok(base_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_until_healthy(
    base_url: str, timeout_s: float, server: ServerProcess | None = None
) -> float:
    """Seconds from launch (or from now) until GET /health answers 200."""
    start = server.launched_at if server else time.perf_counter()
    while True:
        if health_ok(base_url):
            return time.perf_counter() - start
        if server is not None and server.proc.poll() is not None:
            raise ServerError(
                f"the server exited with code {server.proc.returncode} before /health answered; "
                f"see {server.log_path}"
            )
        if time.perf_counter() - start > timeout_s:
            raise ServerError(f"{base_url}/health did not answer within {timeout_s:.0f} s")
        time.sleep(0.25)


def trim_log(path: Path, max_lines: int) -> None:
    """Keep the last `max_lines` lines of a log, noting how many were dropped."""
    if not path.exists():
        return
    total = 0
    tail: deque[bytes] = deque(maxlen=max_lines)
    with open(path, "rb") as f:
        for line in f:
            total += 1
            tail.append(line)
    if total <= max_lines:
        return
    with open(path, "wb") as f:
        f.write(f"# [trimmed: the first {total - max_lines} of {total} lines dropped]\n".encode())
        f.writelines(tail)
