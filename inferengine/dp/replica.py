"""`EngineReplica`: one data-parallel replica, a Ray actor hosting one engine core.

The core runs its busy loop on a thread of its own (as in `core_proc`, without sockets): requests,
aborts and utility calls arrive through a queue, and each step's outputs leave as msgpack frames
(`ReplicaFrame`: the outputs plus the KV events of its GPU pool and CPU tier) that the API
process reads through the `outputs()` stream. Ray carries calls and frames between nodes and
restarts the actor (its `__init__` again: a new engine, an empty cache) when it dies. If the
loop fails, the process exits, so that Ray restarts it.

This module does not import Ray: `dp/ray_backend.py` wraps the class as an actor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import queue
import socket
import threading
import uuid
from typing import Any

import msgspec

from inferengine.config import EngineConfig
from inferengine.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from inferengine.logger import init_logger

logger = init_logger(__name__)

IDLE_POLL_S = 1.0  # an idle loop wakes this often to check its workers' health
FRAME_POLL_S = 0.5  # the outputs stream wakes this often when there is nothing to send


class ReplicaFrame(msgspec.Struct, array_like=True):
    """What one step of a replica sends back: its outputs and the KV events since the last
    frame, in order: (kind, block hash), kinds as in `core/block_pool.py` (0 removed, 1 stored,
    2 cleared in the GPU pool; 3, 4, 5 the same in the CPU tier)."""

    outputs: EngineCoreOutputs
    kv_events: list[tuple[int, bytes]] = []


encode_frame = msgspec.msgpack.Encoder().encode
decode_frame = msgspec.msgpack.Decoder(ReplicaFrame).decode
encode_requests = msgspec.msgpack.Encoder().encode
decode_requests = msgspec.msgpack.Decoder(list[EngineCoreRequest]).decode

_ADD, _ABORT, _UTILITY, _STOP = range(4)


class EngineLoop:
    """The engine core and its busy loop on a daemon thread."""

    def __init__(self, config: EngineConfig):
        from inferengine.engine.core import EngineCore

        self.config = config
        self.core = EngineCore(config)
        self.kv = self.core.scheduler.kv_cache_manager
        self.kv.enable_kv_events()
        self.inputs: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.frames: queue.Queue[bytes] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="EngineReplicaLoop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            logger.exception("the replica's engine loop failed; the process exits")
            os._exit(1)  # Ray restarts the actor

    def _loop(self) -> None:
        core = self.core
        while True:
            block = not core.has_unfinished_requests()
            try:
                while True:
                    kind, payload = self.inputs.get(block=block, timeout=IDLE_POLL_S)
                    if kind == _STOP:
                        return
                    self._handle(kind, payload)
                    block = False
            except queue.Empty:
                if block:
                    core.check_health()
            outputs = core.step() if core.has_unfinished_requests() else None
            if outputs is not None and not core.has_unfinished_requests():
                # gone idle: the router's view of its load must not keep the last busy step's
                outputs.scheduler_stats = core.scheduler.make_stats()
                self._send(outputs, force=True)
            else:
                self._send(outputs)

    def _handle(self, kind: int, payload: Any) -> None:
        if kind == _ADD:
            for request in payload:
                self.core.add_request(request)
        elif kind == _ABORT:
            self.core.abort_requests(payload)
        elif kind == _UTILITY:
            from inferengine.engine.core_proc import run_utility

            method, args, future = payload
            result = run_utility(self.core, 0, method, args)
            if result.error:
                future.set_exception(RuntimeError(result.error))
            else:
                future.set_result(msgspec.to_builtins(result.result))

    def _send(self, outputs: EngineCoreOutputs | None, force: bool = False) -> None:
        has_outputs = outputs is not None and (outputs.outputs or outputs.errors)
        if not has_outputs and not self.kv.pool.kv_events and not force:
            return
        events = self.kv.take_kv_events()
        self.frames.put(encode_frame(ReplicaFrame(outputs or EngineCoreOutputs(), events)))

    def next_frames(self, timeout: float) -> list[bytes]:
        """The frames ready now (waiting up to `timeout` for the first); [] if none."""
        try:
            frames = [self.frames.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                frames.append(self.frames.get_nowait())
            except queue.Empty:
                return frames

    def stop(self) -> None:
        self.inputs.put((_STOP, None))
        self.thread.join(timeout=5.0)
        self.core.shutdown()


class EngineReplica:
    """The actor (see the module docstring); every method is a coroutine, so Ray runs it as an
    async actor and the engine thread keeps stepping while calls come and go."""

    def __init__(self, config: EngineConfig, replica_id: int):
        self.replica_id = replica_id
        self.incarnation = uuid.uuid4().hex  # new at every (re)start
        self.engine = EngineLoop(config)
        self.stream = 0  # the newest outputs() stream; older ones stop
        self.info = {
            "replica_id": replica_id,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "node": socket.gethostname(),
            "num_blocks": config.cache_config.num_blocks,
            "max_model_len": config.scheduler_config.max_model_len,
            "attention_backend": self.engine.core.executor.attention_backend_name,
            "attention_backend_timings_ms": self.engine.core.executor.attention_backend_timings_ms,
        }
        logger.info("replica %d ready (pid %d)", replica_id, os.getpid())

    async def ready(self) -> dict[str, Any]:
        return self.info

    async def add_requests(self, payload: bytes) -> None:
        self.engine.inputs.put((_ADD, decode_requests(payload)))

    async def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.inputs.put((_ABORT, request_ids))

    async def utility(self, method: str, args: list) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.engine.inputs.put((_UTILITY, (method, args, future)))
        return await asyncio.wrap_future(future)

    async def outputs(self):
        """Frames as the engine makes them, several at a time when the reader lags."""
        self.stream += 1
        stream = self.stream
        loop = asyncio.get_running_loop()
        while stream == self.stream:
            frames = await loop.run_in_executor(None, self.engine.next_frames, FRAME_POLL_S)
            if frames:
                yield frames

    async def shutdown(self) -> None:
        self.stream += 1
        await asyncio.to_thread(self.engine.stop)
