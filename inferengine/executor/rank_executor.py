"""`RankExecutor`: the executor protocol over ranks that run elsewhere and talk over ZMQ; its
subclasses start the ranks (`MultiprocExecutor`: processes here; `RayExecutor`: Ray actors).

Each call goes to every rank as msgpack frames (a `SchedulerOutput` is plain data, never a
pickled tensor); a step's output comes back from one rank, the first tensor-parallel rank of
the last pipeline stage. A rank that dies or fails makes every pending and later call raise
`EngineDeadError` within a poll interval, and the other ranks are stopped: nothing hangs.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from inferengine import envs, errors
from inferengine.config import EngineConfig
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from inferengine.errors import ConfigError, EngineDeadError, InferEngineError
from inferengine.executor.rank_report import log_memory, log_ranks
from inferengine.logger import init_logger

logger = init_logger(__name__)

POLL_S = 0.1  # how often a waiting executor looks at its ranks' health
_encoder = msgspec.msgpack.Encoder()
_decode_any = msgspec.msgpack.Decoder().decode
_decode_output = msgspec.msgpack.Decoder(ModelRunnerOutput).decode
SHUTDOWN_FRAMES = [b"shutdown", b"0", _encoder.encode(None)]


@dataclass(frozen=True)
class RankExit:
    what: str  # "worker process rank 1 (pid 7) exited with code -9", for the error
    said_why: bool  # it ended by itself, so it reported its error first (wait for that)


class _Step:
    """The handle of a step sent to the ranks; resolving it waits for the output rank."""

    def __init__(self, executor: RankExecutor, seq: int):
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


class RankExecutor:
    """Subclasses implement `_start_ranks`, `_exit_of` and `_stop_ranks`."""

    def __init__(self, config: EngineConfig):
        pc = config.parallel_config
        self.config = config
        self.world_size = pc.world_size
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size
        self.dead_reason: str | None = None
        self._seq = 0
        self._replies: dict[tuple[int, int], bytes] = {}  # (seq, rank) -> payload
        self.ctx = zmq.Context()
        self.reply_sock = self.ctx.socket(zmq.PULL)
        self.cmd_socks: list[zmq.Socket] = []
        try:
            self._start_ranks()
            infos = self._wait(-1, list(range(self.world_size)), envs.engine_startup_timeout_s())
        except BaseException:
            self.shutdown()
            raise
        self.infos = {rank: _decode_any(p) for rank, p in infos.items()}
        log_ranks(self.infos)
        backends = {info["attention_backend"] for info in self.infos.values()}
        if len(backends) > 1:
            self.shutdown()
            raise ConfigError(
                f"the ranks chose different attention backends ({', '.join(sorted(backends))}); "
                "pass one with --attention-backend."
            )

    # ---- for the subclasses ------------------------------------------------------------

    def _start_ranks(self) -> None:
        """Start every rank, connected to the sockets `_bind_sockets` made."""
        raise NotImplementedError

    def _exit_of(self, rank: int) -> RankExit | None:
        """How rank `rank` ended, or None while it runs."""
        raise NotImplementedError

    def _stop_ranks(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the ranks to stop by themselves, then end them."""
        raise NotImplementedError

    def _bind_sockets(self, host: str | None = None) -> tuple[str, list[str]]:
        """The reply socket and one command socket per rank, on IPC paths (`host` None) or TCP
        ports of `host` (ranks on other nodes); returns the addresses the ranks connect to."""
        base = os.path.join(tempfile.gettempdir(), f"inferengine-w-{uuid.uuid4().hex[:12]}")

        def bind(sock: zmq.Socket, name: str) -> str:
            if host is None:
                sock.bind(f"ipc://{base}-{name}")
                return f"ipc://{base}-{name}"
            return f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"

        reply_addr = bind(self.reply_sock, "reply")
        cmd_addrs = []
        for rank in range(self.world_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDTIMEO, int(POLL_S * 1000))
            cmd_addrs.append(bind(sock, f"cmd{rank}"))
            self.cmd_socks.append(sock)
        return reply_addr, cmd_addrs

    # ---- talking to the ranks ----------------------------------------------------------

    def _broadcast(self, method: str, payload: Any = None) -> int:
        self.check_health()
        self._seq += 1
        frames = [method.encode(), str(self._seq).encode(), _encoder.encode(payload)]
        for sock in self.cmd_socks:
            while True:
                try:
                    sock.send_multipart(frames)
                    break
                except zmq.Again:  # the rank is not reading: find out whether it is alive
                    self.check_health()
        return self._seq

    def _wait(self, seq: int, ranks: list[int], timeout_s: float | None = None) -> dict[int, bytes]:
        """The replies of `ranks` to call `seq`; raises if a rank fails or dies first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not all((seq, r) in self._replies for r in ranks):
            if not self._receive(int(POLL_S * 1000)):
                self.check_health()
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"the workers did not answer within {timeout_s:.0f} s")
        return {r: self._replies.pop((seq, r)) for r in ranks}

    def _receive(self, timeout_ms: int) -> bool:
        """Take one reply if one comes within `timeout_ms`; a rank's error raises."""
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
        """A rank's error, led by the death of another rank if that came first (a collective
        fails on every rank when one dies)."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            for other in range(self.world_size):
                ended = self._exit_of(other) if other != rank else None
                if ended is not None and not ended.said_why:
                    return f"{ended.what}; rank {rank} then failed: {error.splitlines()[0]}"
            time.sleep(0.05)
        return f"worker rank {rank} failed: {error}"

    def check_health(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine's workers are gone: {self.dead_reason}")
        for rank in range(self.world_size):
            ended = self._exit_of(rank)
            if ended is not None:
                # A rank that exits by itself said why first (a killed one could not): wait
                # for its words, which a busy machine may deliver after the exit is seen.
                wait_ms = 2000 if ended.said_why else 50
                while self._receive(wait_ms):
                    wait_ms = 50
                self._fail(ended.what)

    def _fail(self, reason: str, error: InferEngineError | None = None) -> None:
        logger.error("%s; stopping the other workers", reason)
        self.dead_reason = reason
        self._stop_ranks(grace_s=0.0)
        if error is not None:
            raise error
        raise EngineDeadError(f"the engine's workers are gone: {reason}")

    def _all(self, method: str, payload: Any = None) -> dict[int, Any]:
        seq = self._broadcast(method, payload)
        replies = self._wait(seq, list(range(self.world_size)))
        return {rank: _decode_any(p) for rank, p in replies.items()}

    # ---- the executor protocol ---------------------------------------------------------

    def determine_num_blocks(self) -> int:
        """Every rank measures; the KV cache gets the smallest count (pages are shared ids)."""
        counts = self._all("determine_num_blocks")
        logger.info("KV pages per rank: %s", counts)
        return min(counts.values())

    def determine_num_host_blocks(self) -> tuple[int, int]:
        answers = list(self._all("determine_num_host_blocks").values())
        return min(a[0] for a in answers), sum(a[1] for a in answers)

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        log_memory(self._all("initialize_cache", [num_blocks, num_host_blocks]))

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> _Step:
        return _Step(self, self._broadcast("execute", scheduler_output))

    def propose_drafts(self, wanted: dict[str, tuple[int, list[int]]]) -> dict[str, list[int]]:
        seq = self._broadcast("propose_drafts", wanted)
        return _decode_any(self._wait(seq, [self.output_rank])[self.output_rank])

    def expert_token_counts(self) -> dict[int, list[int]]:
        """Every pipeline stage's layers, from its first tensor-parallel rank (the ranks of a
        stage route alike)."""
        replies = self._all("expert_token_counts")
        tp = self.config.parallel_config.tensor_parallel_size
        counts: dict[int, list[int]] = {}
        for rank in range(0, self.world_size, tp):
            counts.update(replies[rank])
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
            send_shutdown(self.cmd_socks)
        self._stop_ranks(grace_s=5.0)
        for sock in [*self.cmd_socks, self.reply_sock]:
            sock.close(linger=0)
        self.ctx.term()


def send_shutdown(cmd_socks: list[zmq.Socket]) -> None:
    """Ask every rank to stop (a rank that is gone or not reading is skipped)."""
    for sock in cmd_socks:
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart(SHUTDOWN_FRAMES, flags=zmq.NOBLOCK)
