"""The server under test, run as systemd's `Restart=always` would: started again whenever it
exits, each start's log in a file of its own, its descendants noted so that none outlives it;
and finding the engine-core child of the API server (the process the soak kills)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from .clock import log


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
        """Seconds since the run began."""
        return round(time.monotonic() - self.t0, 3)

    @property
    def incarnation(self) -> int:
        """The index of the latest server start."""
        return len(self.runs) - 1

    async def run(self) -> None:
        """Start the server, wait for it to exit, reap its survivors, start it again."""
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
        """Remember the current server's descendants (to find survivors once it is gone)."""
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
        """Whether start number `run` exited within `timeout` s."""
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
        """Send `sig` to the current server, or to its whole process group."""
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


def serve_command(args: argparse.Namespace, port: int) -> list[str]:
    """The `inferengine serve` command line of every server run: 127.0.0.1:`port`, quiet
    uvicorn, then --server-arg's."""
    exe = shutil.which("inferengine") or "inferengine"
    return [
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
