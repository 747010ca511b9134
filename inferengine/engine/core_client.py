"""Clients of an engine core in another process, over ZMQ (the server's path).

`AsyncMPClient` starts the core process, sends requests and aborts, and hands back
`EngineCoreOutputs` as they arrive. If the process dies, every waiter gets `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import signal
import tempfile
import time
import uuid
import weakref
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from inferengine import envs
from inferengine.config import EngineConfig
from inferengine.core.engine_io import EngineCoreOutputs, EngineCoreRequest
from inferengine.engine.core_proc import Msg, UtilityResult, run_engine_core
from inferengine.errors import EngineDeadError
from inferengine.logger import init_logger

logger = init_logger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
_decode_utility = msgspec.msgpack.Decoder(UtilityResult).decode
_decode_any = msgspec.msgpack.Decoder().decode


def _ipc_addresses() -> tuple[str, str]:
    base = os.path.join(tempfile.gettempdir(), f"inferengine-{uuid.uuid4().hex[:12]}")
    return f"ipc://{base}-in", f"ipc://{base}-out"


class AsyncMPClient:
    def __init__(self, config: EngineConfig):
        """Start the engine-core process at once; sockets are bound in `wait_until_ready`,
        inside the event loop (the core's sockets connect and wait until then)."""
        self.config = config
        self.input_addr, self.output_addr = _ipc_addresses()
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(
            target=run_engine_core,
            args=(config, self.input_addr, self.output_addr),
            name="InferEngineCore",
            # A daemon process may not start children: with several ranks the core starts
            # one worker process each (it exits with the API process: it watches its parent).
            daemon=config.parallel_config.world_size == 1,
        )
        self.proc.start()
        if not self.proc.daemon:  # see above: stop it even if this client is never shut down
            weakref.finalize(self, _terminate, self.proc)
        self.ctx: zmq.asyncio.Context | None = None
        self.ready_info: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self._utility_ids = itertools.count()
        self._utility_waiters: dict[int, asyncio.Future] = {}
        self._outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None

    def _bind(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.bind(self.input_addr)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.bind(self.output_addr)

    # ---- start-up ---------------------------------------------------------------------

    async def wait_until_ready(self) -> dict[str, Any]:
        """Wait for the core's READY message (or its failure) and start the reader tasks."""
        self._bind()
        deadline = time.monotonic() + envs.engine_startup_timeout_s()
        while True:
            if await self.output_socket.poll(timeout=500):
                kind, payload = await self.output_socket.recv_multipart()
                if Msg(kind) == Msg.READY:
                    self.ready_info = _decode_any(payload)
                    break
                if Msg(kind) == Msg.FAILED:
                    self._mark_dead(_decode_any(payload))
                    raise EngineDeadError(f"the engine core failed to start: {self.dead_reason}")
            if not self.proc.is_alive():
                self._mark_dead(exit_reason(self.proc.exitcode))
                raise EngineDeadError(
                    f"the engine core process exited during start-up ({self.dead_reason})."
                )
            if time.monotonic() > deadline:
                self.shutdown()
                raise EngineDeadError("the engine core did not start in time.")
        self._outputs = asyncio.Queue()
        self._reader = asyncio.create_task(self._read_loop())
        self._watchdog = asyncio.create_task(self._watch_process())
        return self.ready_info

    # ---- sending ----------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine core is not running ({self.dead_reason}).")

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        await self.input_socket.send_multipart([Msg.ADD.value, _encoder.encode(request)])

    async def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_reason is None:
            await self.input_socket.send_multipart([Msg.ABORT.value, _encoder.encode(request_ids)])

    async def call_utility(self, method: str, *args: Any, timeout: float = 10.0) -> Any:
        self._check_alive()
        call_id = next(self._utility_ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._utility_waiters[call_id] = future
        payload = _encoder.encode([call_id, method, list(args)])
        await self.input_socket.send_multipart([Msg.UTILITY.value, payload])
        try:
            result: UtilityResult = await asyncio.wait_for(future, timeout)
        finally:
            self._utility_waiters.pop(call_id, None)
        if result.error:
            raise RuntimeError(result.error)
        return result.result

    # ---- receiving --------------------------------------------------------------------

    async def get_output(self) -> EngineCoreOutputs:
        assert self._outputs is not None, "call wait_until_ready() first"
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)  # every later caller sees it too
            raise item
        return item

    async def _read_loop(self) -> None:
        assert self._outputs is not None
        while True:
            kind, payload = await self.output_socket.recv_multipart(copy=False)
            msg = Msg(bytes(kind.buffer))
            if msg == Msg.OUTPUTS:
                self._outputs.put_nowait(_decode_outputs(payload.buffer))
            elif msg == Msg.UTILITY_RESULT:
                result = _decode_utility(payload.buffer)
                waiter = self._utility_waiters.get(result.call_id)
                if waiter is not None and not waiter.done():
                    waiter.set_result(result)
            elif msg == Msg.FAILED:
                self._mark_dead(_decode_any(payload.buffer))

    async def _watch_process(self) -> None:
        while self.dead_reason is None:
            if not self.proc.is_alive():
                self._mark_dead(exit_reason(self.proc.exitcode))
                return
            await asyncio.sleep(0.2)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("engine core died: %s", reason)
        error = EngineDeadError(f"the engine core stopped: {reason}")
        if self._outputs is not None:
            self._outputs.put_nowait(error)
        for waiter in self._utility_waiters.values():
            if not waiter.done():
                waiter.set_exception(error)

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    # ---- shutdown ---------------------------------------------------------------------

    def shutdown(self, timeout: float = 5.0) -> None:
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
        if self.proc.is_alive():
            self.proc.terminate()  # the core exits at once on SIGTERM; it keeps no state
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(1.0)
        if self.dead_reason is None:
            self.dead_reason = "shut down"
        if self.ctx is not None:
            self.input_socket.close(linger=0)
            self.output_socket.close(linger=0)
            self.ctx.term()


def exit_reason(exitcode: int | None) -> str:
    """'exit code 1', or for a process a signal ended, 'exit code -9 (SIGKILL)'."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"exit code {exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            pass
    return f"exit code {exitcode}"


def _terminate(proc) -> None:
    if proc.exitcode is None:
        proc.terminate()
        proc.join(5.0)
        if proc.exitcode is None:
            proc.kill()
