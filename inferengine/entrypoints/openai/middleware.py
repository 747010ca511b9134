"""The server's gate (pure ASGI): API key, body-size limit, draining, and in-flight counting."""

from __future__ import annotations

import hmac
from typing import Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferengine.entrypoints.openai.errors import status_response

# Paths any client may call, even without the API key and while draining.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/docs", "/redoc", "/openapi.json"})
_DISCARD_LIMIT = 64 << 20  # past this, an oversized body is not read to its end


class GateState(Protocol):
    api_key: str | None
    max_request_body_bytes: int
    draining: bool
    in_flight: int


class GateMiddleware:
    def __init__(self, app: ASGIApp, state: GateState):
        self.app = app
        self.state = state
        self._key = state.api_key.encode() if state.api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        state = self.state
        if self._key is not None and not self._authorized(scope):
            response = status_response(
                401, "Invalid or missing API key; send `Authorization: Bearer <key>`."
            )
            await response(scope, receive, send)
            return
        if state.draining:
            response = status_response(
                503, "The server is shutting down; retry on another replica."
            )
            await response(scope, receive, send)
            return
        body = await self._read_body(scope, receive)
        if body is None:
            limit = state.max_request_body_bytes
            response = status_response(413, f"The request body is larger than {limit} bytes.")
            await response(scope, receive, send)
            return
        state.in_flight += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            state.in_flight -= 1

    def _authorized(self, scope: Scope) -> bool:
        assert self._key is not None
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    return hmac.compare_digest(token.strip(), self._key)
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


async def _discard(receive: Receive, size: int) -> None:
    while size < _DISCARD_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


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
