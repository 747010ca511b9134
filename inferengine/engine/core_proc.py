"""The engine core in its own process: a busy loop fed and drained over ZMQ by two I/O threads.

Messages are msgpack (msgspec) frames `[kind, payload]`; the payloads are token ids and
sampling parameters, never text. The I/O threads decode and encode while the main thread runs
model steps, so socket work overlaps GPU work.
"""

from __future__ import annotations

import gc
import os
import queue
import signal
import threading
import time
from enum import Enum
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from inferengine.config import EngineConfig
from inferengine.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from inferengine.logger import init_logger

if TYPE_CHECKING:
    from inferengine.engine.core import EngineCore

logger = init_logger(__name__)


class Msg(bytes, Enum):
    ADD = b"A"
    ABORT = b"X"
    UTILITY = b"U"  # (call_id, method name, args) -> (call_id, result or error)
    SHUTDOWN = b"S"
    OUTPUTS = b"O"
    UTILITY_RESULT = b"R"
    READY = b"Y"
    FAILED = b"F"  # the core stopped on an error; payload: the message


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


_encoder = msgspec.msgpack.Encoder()
_decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
_decode_any = msgspec.msgpack.Decoder().decode

UTILITY_METHODS = ("reset_prefix_cache", "get_stats", "device_memory", "ping")


class EngineCoreProc:
    """Wraps `EngineCore` with the socket loop; lives in the child process."""

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str):
        from inferengine.engine.core import EngineCore

        self.parent_pid = os.getppid()
        self.inputs: queue.Queue[tuple[Msg, Any]] = queue.Queue()
        self.outputs: queue.Queue[tuple[Msg, bytes] | None] = queue.Queue()
        self.ctx = zmq.Context()
        threading.Thread(target=self._send_loop, args=(output_addr,), daemon=True).start()
        try:
            self.core = EngineCore(config)
        except BaseException as e:
            self.outputs.put((Msg.FAILED, _encoder.encode(f"{type(e).__name__}: {e}")))
            self.outputs.put(None)
            time.sleep(1.0)  # let the sender deliver the error
            raise
        ready = {
            "num_blocks": config.cache_config.num_blocks,
            "max_model_len": config.scheduler_config.max_model_len,  # lowered to fit the cache
            "attention_backend": self.core.executor.attention_backend_name,
            "attention_backend_timings_ms": self.core.executor.attention_backend_timings_ms,
            "pid": os.getpid(),
        }
        threading.Thread(target=self._recv_loop, args=(input_addr,), daemon=True).start()
        self.outputs.put((Msg.READY, _encoder.encode(ready)))

    # ---- I/O threads ------------------------------------------------------------------

    def _recv_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.connect(addr)
        while True:
            kind, payload = sock.recv_multipart(copy=False)
            msg = Msg(bytes(kind.buffer))
            if msg == Msg.ADD:
                self.inputs.put((msg, _decode_request(payload.buffer)))
            else:
                self.inputs.put((msg, _decode_any(payload.buffer)))

    def _send_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(addr)
        while True:
            item = self.outputs.get()
            if item is None:
                sock.close(linger=2000)
                return
            sock.send_multipart(item, copy=False)

    # ---- the busy loop ----------------------------------------------------------------

    def run(self) -> None:
        core = self.core
        while True:
            block = not core.has_unfinished_requests()
            try:
                while True:
                    msg, payload = self.inputs.get(block=block, timeout=1.0 if block else None)
                    if not self._handle(msg, payload):
                        return
                    block = False
            except queue.Empty:
                if os.getppid() != self.parent_pid:
                    logger.warning("the API process is gone; the engine core exits")
                    return
                core.check_health()
            if core.has_unfinished_requests():
                outputs: EngineCoreOutputs = core.step()
                if outputs.outputs or outputs.errors:
                    self.outputs.put((Msg.OUTPUTS, _encoder.encode(outputs)))

    def _handle(self, msg: Msg, payload: Any) -> bool:
        if msg == Msg.ADD:
            self.core.add_request(payload)
        elif msg == Msg.ABORT:
            self.core.abort_requests(payload)
        elif msg == Msg.UTILITY:
            call_id, method, args = payload
            self.outputs.put(
                (Msg.UTILITY_RESULT, _encoder.encode(self._utility(call_id, method, args)))
            )
        elif msg == Msg.SHUTDOWN:
            return False
        return True

    def _utility(self, call_id: int, method: str, args: list) -> UtilityResult:
        return run_utility(self.core, call_id, method, args)

    def shutdown(self) -> None:
        self.outputs.put(None)
        self.core.shutdown()


def run_utility(core: EngineCore, call_id: int, method: str, args: list) -> UtilityResult:
    """One utility call on the engine core (between steps), its error caught."""
    try:
        if method == "reset_prefix_cache":
            return UtilityResult(call_id, core.reset_prefix_cache())
        if method == "get_stats":
            return UtilityResult(call_id, core.scheduler.make_stats())
        if method == "device_memory":
            return UtilityResult(call_id, _device_memory_used(core.config.device))
        if method == "expert_token_counts":
            return UtilityResult(call_id, core.expert_token_counts())
        if method == "ping":
            return UtilityResult(call_id, "pong")
        if method == "activity":  # GET /stats: leased sessions, requests under a grammar
            sessions = core.scheduler.kv_cache_manager.live_sessions(*args)
            structured = core.structured
            return UtilityResult(
                call_id,
                {
                    "sessions": [{"key": k, "expires_in_s": s} for k, s in sessions],
                    "num_structured_output_requests": len(structured.matchers)
                    + len(structured.waiting),
                },
            )
        if method == "kv_events":  # for `inferengine router` (GET /kv_events)
            from inferengine.core.kv_event_log import event_log

            kv = core.scheduler.kv_cache_manager
            return UtilityResult(call_id, event_log(kv.pool, kv.host).read(*args))
        return UtilityResult(call_id, error=f"unknown utility {method!r}")
    except Exception as e:
        return UtilityResult(call_id, error=f"{type(e).__name__}: {e}")


def _device_memory_used(device: str) -> int | None:
    """Bytes in use on the engine's GPU (by every process), or None on the CPU."""
    if device != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Entry point of the engine-core process."""
    # The API process owns Ctrl-C and SIGTERM handling; it shuts the core down itself. The core
    # leaves the process group so that a signal to the group (a terminal, `timeout`, `kill --
    # -PGID`) reaches only the API process, which drains its requests before stopping the core.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    try:
        proc = EngineCoreProc(config, input_addr, output_addr)
    except BaseException:
        logger.exception("engine core failed to start")
        os._exit(1)
    # Everything built so far lives as long as the process: keep it out of the cyclic garbage
    # collector's passes, whose pauses would otherwise land between GPU steps.
    gc.collect()
    gc.freeze()
    try:
        proc.run()
    except BaseException as e:
        logger.exception("engine core died")
        proc.outputs.put((Msg.FAILED, _encoder.encode(f"{type(e).__name__}: {e}")))
        proc.outputs.put(None)
        time.sleep(1.0)
        os._exit(1)
    proc.shutdown()
    time.sleep(0.2)
    os._exit(0)
