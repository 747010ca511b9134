"""One rank's loop: joins the torch.distributed world, builds its `Worker` and runs what the
executor sends until told to stop, in a worker process (`run_worker`) or a Ray actor
(`serve_rank`, from `ray_worker.py`).

Messages in are msgpack frames `[method, seq, payload]`; every rank runs every call (the
collectives need them all) and the ranks the executor asks reply `[rank, kind, seq, payload]`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import traceback
from typing import Any

import msgspec
import zmq

from inferengine.config import EngineConfig
from inferengine.core.sched_output import SchedulerOutput
from inferengine.errors import InferEngineError
from inferengine.executor.rank_report import RankPlace, memory_info, ready_info

_encoder = msgspec.msgpack.Encoder()
_decode_any = msgspec.msgpack.Decoder().decode
_decode_step = msgspec.msgpack.Decoder(SchedulerOutput).decode
_decode_drafts = msgspec.msgpack.Decoder(dict[str, tuple[int, list[int]]]).decode


def _die_with_parent(parent_pid: int, by_signal: bool) -> None:
    """Exit with the process that started this one. On Linux, when that process started it
    from its main thread, the kernel kills this one when it goes, even inside a collective (the
    signal follows the starting thread, so an engine built in a passing thread only relies on
    the check here and on its workers being daemons)."""
    if by_signal and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # it went before the line above took effect
        os._exit(1)


def run_worker(
    config: EngineConfig,
    rank: int,
    init_method: str,
    cmd_addr: str,
    reply_addr: str,
    answers_steps: bool,
    parent: tuple[int, bool],
) -> None:
    """Entry point of a worker process. Only the rank that `answers_steps` replies to `execute`
    and `propose_drafts`; `parent` is (the starting process's pid, whether it started this one
    from its main thread)."""
    _die_with_parent(*parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    place = RankPlace(socket.gethostname(), device_index=rank)
    os._exit(serve_rank(config, rank, init_method, cmd_addr, reply_addr, answers_steps, place))


def serve_rank(
    config: EngineConfig,
    rank: int,
    init_method: str,
    cmd_addr: str,
    reply_addr: str,
    answers_steps: bool,
    place: RankPlace,
) -> int:
    """Run rank `rank` until the executor says stop (returns 0) or it fails (reports why, then
    returns 1: its torch.distributed world is broken, so the caller must exit)."""
    ctx = zmq.Context()
    cmds = ctx.socket(zmq.PULL)
    cmds.connect(cmd_addr)
    reply = ctx.socket(zmq.PUSH)
    reply.connect(reply_addr)

    def send(kind: str, seq: int, payload: Any) -> None:
        reply.send_multipart(
            [str(rank).encode(), kind.encode(), str(seq).encode(), _encoder.encode(payload)]
        )

    try:
        worker = _start(config, rank, init_method, place.device_index)
        send("ready", -1, ready_info(worker, place))
        from inferengine.worker.pending_step import DeferredSampling

        deferred: tuple[int, Any] | None = None  # (seq, step) waiting for its grammar masks
        while True:
            method, seq_raw, payload = cmds.recv_multipart()
            method_name, seq = method.decode(), int(seq_raw)
            if method_name == "shutdown":
                break
            if method_name == "execute":
                step = worker.runner.execute_model_async(_decode_step(payload))
                if isinstance(step, DeferredSampling):
                    deferred = (seq, step)
                    continue
                kind, result = "output", step.resolve()
            elif method_name == "grammar":  # the masks of the deferred step: its reply follows
                assert deferred is not None, "grammar masks for no step"
                (seq, step), deferred = deferred, None
                step.provide_grammar(*_decode_any(payload))
                kind, result = "output", step.resolve()
            else:
                kind, result = _call(worker, method_name, payload)
            if method_name in ("execute", "grammar", "propose_drafts") and not answers_steps:
                continue
            send(kind, seq, result)
    except BaseException as e:  # every failure is reported, then the rank exits
        message = e.message if isinstance(e, InferEngineError) else str(e)
        send(
            "error",
            -1,
            {"type": type(e).__name__, "message": message, "trace": traceback.format_exc(limit=6)},
        )
        # Closing alone does not flush: the context's term waits (up to the linger) until the
        # error has left, which os._exit would otherwise cut short.
        reply.close(linger=2000)
        cmds.close(linger=0)
        ctx.term()
        return 1
    from inferengine.distributed.parallel_state import destroy_distributed

    destroy_distributed()
    reply.close(linger=1000)
    cmds.close(linger=0)
    ctx.term()
    return 0


def _start(config: EngineConfig, rank: int, init_method: str, device_index: int):
    import torch

    from inferengine.distributed.parallel_state import init_distributed
    from inferengine.worker.worker import Worker

    pc = config.parallel_config
    if config.device == "cuda":
        device = torch.device("cuda", device_index)
        torch.cuda.set_device(device)
    else:
        from inferengine.worker.cpu_env import configure_threads

        device = torch.device("cpu")
        configure_threads(pc.world_size)
    init_distributed(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method, device)
    return Worker(config, rank, device_index)


def _call(worker, method: str, payload: bytes) -> tuple[str, Any]:
    if method == "determine_num_blocks":
        return "result", worker.determine_num_blocks()
    if method == "determine_num_host_blocks":
        return "result", worker.determine_num_host_blocks()
    if method == "initialize_cache":
        worker.initialize_cache(*_decode_any(payload))
        return "result", memory_info(worker)
    if method == "propose_drafts":
        return "result", worker.runner.propose_drafts(_decode_drafts(payload))
    if method == "expert_token_counts":
        return "result", worker.expert_token_counts()
    raise ValueError(f"unknown worker method {method!r}")
