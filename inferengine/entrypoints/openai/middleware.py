"""The server's gate (pure ASGI): API key, body-size limit, bodies that are not text (invalid
UTF-8, lone surrogates: `text_check.py`), draining, and in-flight counting.

While the server drains, the gate also ends the requests still running once the drain's time is
up (`cut_off`): a 503 error, or on a stream a last error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferengine.entrypoints.openai.errors import (
    ServiceUnavailableError,
    error_response,
    internal_error_response,
    status_response,
    stream_error_event,
)
from inferengine.entrypoints.openai.streaming import SSE_DONE
from inferengine.entrypoints.openai.text_check import body_problem
from inferengine.entrypoints.web import is_page_path

# Paths any client may call, even without the API key and while draining.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/redoc", "/openapi.json"})
_DISCARD_LIMIT = 64 << 20  # past this, an oversized body is not read to its end


class GateState(Protocol):
    api_key: str | None
    max_request_body_bytes: int
    draining: bool
    in_flight: int
    cut_off: asyncio.Event  # set when a drain's time is up: running requests end with a 503


CUT_OFF_MESSAGE = (
    "The server is shutting down and this request did not finish within its drain timeout; "
    "retry on another replica."
)


class GateMiddleware:
    def __init__(self, app: ASGIApp, state: GateState):
        self.app = app
        self.state = state
        self._key = state.api_key.encode() if state.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or _page_file(scope):
            await self.app(scope, receive, send)
            return
        state = self.state
        if self._key is not None and not self._authorized(scope):
            response = status_response(
                401,
                "Invalid or missing API key; send `Authorization: Bearer <key>` (or, as "
                "Anthropic's clients do, `x-api-key: <key>`).",
            )
            await response(scope, receive, send)
            return
        if state.draining:
            response = status_response(
                503, "The server is shutting down; retry on another replica."
            )
            await response(scope, receive, send)
            return
        state.in_flight += 1
        try:
            await self._until_cut_off(scope, receive, send)
        finally:
            state.in_flight -= 1

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._read_body(scope, receive)
        if body is None:
            limit = self.state.max_request_body_bytes
            response = status_response(413, f"The request body is larger than {limit} bytes.")
            await response(scope, receive, send)
            return
        problem = body_problem(body)
        if problem is not None:  # not text: a 400 naming the field, before any parsing
            await error_response(problem)(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _until_cut_off(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request; if `cut_off` comes first, stop it (which aborts its engine
        requests) and end its response with a 503."""
        response = _TrackedResponse(send)
        serving = asyncio.ensure_future(self._serve(scope, receive, response.send))
        cut_off = asyncio.ensure_future(self.state.cut_off.wait())
        try:
            await asyncio.wait({serving, cut_off}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cut_off.cancel()
            finished = serving.done()
            serving.cancel()
            await asyncio.gather(serving, cut_off, return_exceptions=True)
        if finished:
            error = serving.exception()
            if error is None:
                return
            if response.started or not isinstance(error, Exception):
                raise error
            # A bug: a 500 here, logged once, keeps the connection (re-raised, uvicorn would log
            # it again and close the connection under the client's next request).
            path = scope["path"]
            await internal_error_response(path, error)(scope, receive, response.send)
        else:
            await response.end_with_503(scope, receive)

    def _authorized(self, scope: Scope) -> bool:
        assert self._key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    return hmac.compare_digest(token.strip(), self._key)
            if name == b"x-api-key":  # Anthropic's header
                return hmac.compare_digest(value.strip(), self._key)
        return False

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None when it is over the limit (then read to its end and dropped)."""
        limit = self.state.max_request_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                await _discard(receive, 0)
                return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # disconnected; the app will see it next
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                if message.get("more_body", False):
                    await _discard(receive, size)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _page_file(scope: Scope) -> bool:
    """A GET of the web page's own files: they load without the key (every API call the page
    makes then needs it)."""
    return scope["method"] in ("GET", "HEAD") and is_page_path(scope["path"])


async def _discard(receive: Receive, size: int) -> None:
    while size < _DISCARD_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class _TrackedResponse:
    """A `send` that notes how far the response got, so that the gate can end it."""

    def __init__(self, send: Send):
        self._send = send
        self.started = self.complete = self.event_stream = False

    async def send(self, message: Message) -> None:
        await self._send(message)
        if message["type"] == "http.response.start":
            self.started = True
            self.event_stream = any(
                name.lower() == b"content-type" and value.startswith(b"text/event-stream")
                for name, value in message.get("headers", ())
            )
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True

    async def end_with_503(self, scope: Scope, receive: Receive) -> None:
        """A 503 error; once a stream has begun, its last events: the error, then `[DONE]`."""
        if not self.started:
            await status_response(503, CUT_OFF_MESSAGE)(scope, receive, self._send)
        elif not self.complete:
            end = ""
            if self.event_stream:
                end = stream_error_event(ServiceUnavailableError(CUT_OFF_MESSAGE)) + SSE_DONE
            await self._send(
                {"type": "http.response.body", "body": end.encode(), "more_body": False}
            )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands back the buffered body once, then passes through (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
