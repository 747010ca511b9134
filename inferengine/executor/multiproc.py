"""`MultiprocExecutor`: one worker process per rank (tensor × pipeline parallel).

Each call goes to every rank as msgpack frames over ZMQ (a `SchedulerOutput` is plain data, never
a pickled tensor); a step's output comes back from one rank, the first tensor-parallel rank of
the last pipeline stage. A worker that dies or fails makes every pending and later call raise
`EngineDeadError` within a poll interval, and the other workers are stopped: nothing hangs.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import tempfile
import threading
import time
import uuid
import weakref
from typing import Any

import msgspec
import zmq

from inferengine import envs, errors
from inferengine.config import EngineConfig
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from inferengine.errors import ConfigError, EngineDeadError, InferEngineError
from inferengine.executor.worker_proc import run_worker
from inferengine.logger import init_logger

logger = init_logger(__name__)

POLL_S = 0.1  # how often a waiting executor looks at its workers' health
_encoder = msgspec.msgpack.Encoder()
_decode_any = msgspec.msgpack.Decoder().decode
_decode_output = msgspec.msgpack.Decoder(ModelRunnerOutput).decode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Step:
    """The handle of a step sent to the workers; resolving it waits for the output rank."""

    def __init__(self, executor: MultiprocExecutor, seq: int):
        self.executor = executor
        self.seq = seq
        self.graph_size: int | None = None
        self._output: ModelRunnerOutput | None = None

    def provide_grammar(self, req_ids: list[str], bitmask: bytes) -> None:
        self.executor._broadcast("grammar", [req_ids, bitmask])

    def resolve(self) -> ModelRunnerOutput:
        if self._output is None:
            reply = self.executor._wait(self.seq, [self.executor.output_rank])
            self._output = _decode_output(reply[self.executor.output_rank])
        return self._output


class MultiprocExecutor:
    def __init__(self, config: EngineConfig):
        pc = config.parallel_config
        self.config = config
        self.world_size = pc.world_size
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        self.dead_reason: str | None = None
        self._seq = 0
        self._replies: dict[tuple[int, int], bytes] = {}  # (seq, rank) -> payload
        base = os.path.join(tempfile.gettempdir(), f"inferengine-w-{uuid.uuid4().hex[:12]}")
        self.ctx = zmq.Context()
        self.reply_sock = self.ctx.socket(zmq.PULL)
        self.reply_sock.bind(f"ipc://{base}-reply")
        self.cmd_socks = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        try:
            self._start_workers(config, base)
            infos = self._wait(-1, list(range(self.world_size)), envs.engine_startup_timeout_s())
        except BaseException:
            self.shutdown()
            raise
        # Stops the workers if the engine is dropped without a shutdown (an `LLM` going away).
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.cmd_socks)
        self.infos = {rank: _decode_any(p) for rank, p in infos.items()}
        for rank, info in sorted(self.infos.items()):
            logger.info(
                "rank %d (pid %d): weights %.2f GiB, attention %s, all-reduce %s",
                rank,
                info["pid"],
                info["weights_bytes"] / (1 << 30),
                info["attention_backend"],
                info["all_reduce"],
            )

        backends = {info["attention_backend"] for info in self.infos.values()}
        if len(backends) > 1:
            self.shutdown()
            raise ConfigError(
                f"the ranks chose different attention backends ({', '.join(sorted(backends))}); "
                "pass one with --attention-backend."
            )

    def _start_workers(self, config: EngineConfig, base: str) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        mp = multiprocessing.get_context("spawn")
        parent = (os.getpid(), threading.current_thread() is threading.main_thread())
        for rank in range(self.world_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, int(POLL_S * 1000))
            sock.bind(f"ipc://{base}-cmd{rank}")
            self.cmd_socks.append(sock)
            proc = mp.Process(
                target=run_worker,
                args=(
                    config,
                    rank,
                    init_method,
                    f"ipc://{base}-cmd{rank}",
                    f"ipc://{base}-reply",
                    rank == self.output_rank,
                    parent,
                ),
                name=f"InferEngineWorker-{rank}",
                daemon=True,
            )
            proc.start()
            self.procs.append(proc)

    # ---- talking to the workers --------------------------------------------------------

    def _broadcast(self, method: str, payload: Any = None) -> int:
        self.check_health()
        self._seq += 1
        frames = [method.encode(), str(self._seq).encode(), _encoder.encode(payload)]
        for sock in self.cmd_socks:
            while True:
                try:
                    sock.send_multipart(frames)
                    break
                except zmq.Again:  # the worker is not reading: find out whether it is alive
                    self.check_health()
        return self._seq

    def _wait(self, seq: int, ranks: list[int], timeout_s: float | None = None) -> dict[int, bytes]:
        """The replies of `ranks` to call `seq`; raises if a worker fails or dies first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not all((seq, r) in self._replies for r in ranks):
            if not self._receive(int(POLL_S * 1000)):
                self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"the workers did not answer within {timeout_s:.0f} s")
        return {r: self._replies.pop((seq, r)) for r in ranks}

    def _receive(self, timeout_ms: int) -> bool:
        """Take one reply if one comes within `timeout_ms`; a worker's error raises."""
        if not self.reply_sock.poll(timeout_ms):
            return False
        rank, kind, seq, payload = self.reply_sock.recv_multipart()
        if kind == b"error":
            error = _decode_any(payload)
            user_error = getattr(errors, error["type"], None)
            if isinstance(user_error, type) and issubclass(user_error, InferEngineError):
                # A mistake the user can fix (a checkpoint, a setting): its own words and class.
                self._fail(
                    f"worker rank {int(rank)}: {error['message']}", user_error(error["message"])
                )
            self._fail(self._root_cause(int(rank), f"{error['type']}: {error['message']}"))
        self._replies[(int(seq), int(rank))] = payload
        return True

    def _root_cause(self, rank: int, error: str) -> str:
        """A rank's error, led by the exit of another rank if that came first (a collective
        fails on every rank when one dies)."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for other, proc in enumerate(self.procs):
                if other != rank and proc.exitcode is not None and proc.exitcode < 0:
                    return (
                        f"worker process rank {other} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode}; rank {rank} then failed: {error.splitlines()[0]}"
                    )
            time.sleep(0.05)
        return f"worker rank {rank} failed: {error}"

    def check_health(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine's workers are gone: {self.dead_reason}")
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                # A worker that exits by itself said why first (a killed one could not): wait
                # for its words, which a busy machine may deliver after the exit is seen.
                wait_ms = 2000 if proc.exitcode > 0 else 50
                while self._receive(wait_ms):
                    wait_ms = 50
                self._fail(
                    f"worker process rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                )

    def _fail(self, reason: str, error: InferEngineError | None = None) -> None:
        logger.error("%s; stopping the other workers", reason)
        self.dead_reason = reason
        self._stop_processes(grace_s=0.0)
        if error is not None:
            raise error
        raise EngineDeadError(f"the engine's workers are gone: {reason}")

    # ---- the executor protocol ---------------------------------------------------------

    def determine_num_blocks(self) -> int:
        """Every rank measures; the KV cache gets the smallest count (pages are shared ids)."""
        seq = self._broadcast("determine_num_blocks")
        counts = {
            r: _decode_any(p) for r, p in self._wait(seq, list(range(self.world_size))).items()
        }
        logger.info("KV pages per rank: %s", counts)
        return min(counts.values())

    def determine_num_host_blocks(self) -> tuple[int, int]:
        seq = self._broadcast("determine_num_host_blocks")
        answers = [_decode_any(p) for p in self._wait(seq, list(range(self.world_size))).values()]
        return min(a[0] for a in answers), sum(a[1] for a in answers)

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        seq = self._broadcast("initialize_cache", [num_blocks, num_host_blocks])
        self._wait(seq, list(range(self.world_size)))

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> _Step:
        return _Step(self, self._broadcast("execute", scheduler_output))

    def propose_drafts(self, wanted: dict[str, tuple[int, list[int]]]) -> dict[str, list[int]]:
        seq = self._broadcast("propose_drafts", wanted)
        return _decode_any(self._wait(seq, [self.output_rank])[self.output_rank])

    def expert_token_counts(self) -> dict[int, list[int]]:
        """Every pipeline stage's layers, from its first tensor-parallel rank (the ranks of a
        stage route alike)."""
        seq = self._broadcast("expert_token_counts")
        replies = self._wait(seq, list(range(self.world_size)))
        tp = self.config.parallel_config.tensor_parallel_size
        counts: dict[int, list[int]] = {}
        for rank in range(0, self.world_size, tp):
            counts.update(_decode_any(replies[rank]))
        return counts

    def read_kv_pages(self, locations: list[tuple[str, int]]) -> list:
        raise ConfigError("KV export works on one-rank engines only so far.")

    def write_host_pages(self, slots: list[int], pages: list) -> None:
        raise ConfigError("KV import works on one-rank engines only so far.")

    @property
    def attention_backend_name(self) -> str:
        return self.infos[self.output_rank]["attention_backend"]

    @property
    def attention_backend_timings_ms(self) -> dict[str, float]:
        return self.infos[self.output_rank]["attention_backend_timings_ms"]

    def shutdown(self) -> None:
        if self.dead_reason is None:
            self.dead_reason = "shut down"
            frames = [b"shutdown", b"0", _encoder.encode(None)]
            for sock in self.cmd_socks:
                with contextlib.suppress(zmq.ZMQError):
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
        self._stop_processes(grace_s=5.0)
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()
        for sock in [*self.cmd_socks, self.reply_sock]:
            sock.close(linger=0)
        self.ctx.term()

    def _stop_processes(self, grace_s: float) -> None:
        _join_or_kill(self.procs, grace_s)


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
    for sock in cmd_socks:
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart([b"shutdown", b"0", _encoder.encode(None)], flags=zmq.NOBLOCK)
    _join_or_kill(procs, grace_s=5.0)
