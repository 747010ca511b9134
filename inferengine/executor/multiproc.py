"""`MultiprocExecutor`: one spawned worker process per rank (tensor × pipeline parallel) on this
machine, reached over IPC sockets; `RankExecutor` does the talking and the failure handling."""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time
import weakref

from inferengine.config import EngineConfig
from inferengine.executor.rank_executor import RankExecutor, RankExit, send_shutdown
from inferengine.executor.worker_proc import run_worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(RankExecutor):
    def __init__(self, config: EngineConfig):
        self.procs: list[multiprocessing.process.BaseProcess] = []
        super().__init__(config)
        # Stops the workers if the engine is dropped without a shutdown (an `LLM` going away).
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.cmd_socks)

    def _start_ranks(self) -> None:
        reply_addr, cmd_addrs = self._bind_sockets()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        mp = multiprocessing.get_context("spawn")
        parent = (os.getpid(), threading.current_thread() is threading.main_thread())
        for rank in range(self.world_size):
            proc = mp.Process(
                target=run_worker,
                args=(
                    self.config,
                    rank,
                    init_method,
                    cmd_addrs[rank],
                    reply_addr,
                    rank == self.output_rank,
                    parent,
                ),
                name=f"InferEngineWorker-{rank}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)

    def _exit_of(self, rank: int) -> RankExit | None:
        if rank >= len(self.procs) or self.procs[rank].exitcode is None:
            return None
        proc = self.procs[rank]
        what = f"worker process rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
        return RankExit(what, said_why=proc.exitcode > 0)

    def _stop_ranks(self, grace_s: float) -> None:
        _join_or_kill(self.procs, grace_s)

    def shutdown(self) -> None:
        super().shutdown()
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()


def _join_or_kill(procs: list, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        proc.join(2.0)


def _stop(procs: list, cmd_socks: list) -> None:
    """The finalizer of a dropped executor: ask the workers to stop, then make sure."""
    send_shutdown(cmd_socks)
    _join_or_kill(procs, grace_s=5.0)
