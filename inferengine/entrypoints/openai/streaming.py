"""Engine streams for HTTP: start them eagerly, merge several, stop them when the client leaves.

Every path that ends a request early (client gone, error, shutdown) closes the `AsyncLLM`
generator, whose `finally` aborts the request in the engine core and frees its KV pages.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from inferengine.errors import excerpt
from inferengine.logger import init_logger
from inferengine.outputs import RequestOutput

logger = init_logger(__name__)

T = TypeVar("T")
SSE_DONE = "data: [DONE]\n\n"
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"


class EngineStream:
    """One `AsyncLLM.generate` stream, started at once.

    `start()` runs the generator up to its first wait, so a request the engine refuses (bad
    parameters, queue full, engine dead) raises there, before any response header is sent.
    """

    def __init__(self, gen: AsyncGenerator[RequestOutput, None]):
        self._gen = gen
        self._first: asyncio.Task[RequestOutput] | None = None

    async def start(self) -> None:
        async def first() -> RequestOutput:
            return await self._gen.__anext__()

        self._first = asyncio.ensure_future(first())
        await asyncio.sleep(0)  # the generator validates and submits before it first waits
        if self._first.done() and self._first.exception() is not None:
            self._first.result()

    def __aiter__(self) -> EngineStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            try:
                return await self._first
            finally:
                self._first = None
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        first, self._first = self._first, None
        if first is not None and not first.done():
            first.cancel()
            with contextlib.suppress(BaseException):
                await first
        elif first is not None and not first.cancelled():
            first.exception()  # retrieved: no "exception was never retrieved" warning
        await self._gen.aclose()


async def start_streams(gens: Sequence[AsyncGenerator[RequestOutput, None]]) -> list[EngineStream]:
    """Start every stream; if one is refused, close the others and raise its error."""
    streams: list[EngineStream] = []
    try:
        for gen in gens:
            stream = EngineStream(gen)
            streams.append(stream)
            await stream.start()
    except BaseException:
        await close_streams(streams)
        for gen in gens[len(streams) :]:
            await gen.aclose()
        raise
    return streams


async def close_streams(streams: Sequence[EngineStream]) -> None:
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()


async def merge_streams(
    streams: Sequence[EngineStream],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(stream index, output) from all streams as they come; the first error ends all."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: EngineStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as e:
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await close_streams(streams)


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | Response:
    """Await `work`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return task.result()


class SSEResponse(StreamingResponse):
    """Server-Sent Events that stop (and close their source) as soon as the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None], **kwargs: Any):
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, headers=headers, **kwargs)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, watcher):
                task.cancel()
            await asyncio.gather(streaming, watcher, return_exceptions=True)
            body: Any = self.body_iterator
            await body.aclose()
        error = None if streaming.cancelled() else streaming.exception()
        if error is not None and not isinstance(error, OSError):  # OSError: the client left
            logger.error("a streamed response failed: %s", excerpt(repr(error)))
