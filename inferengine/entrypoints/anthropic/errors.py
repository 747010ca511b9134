"""Errors on the Messages routes in Anthropic's shape: `{"type": "error", "error": {type, message}}`.

Every error the server makes goes out in OpenAI's shape (`openai/errors.py`), from wherever it
arises: the gate (API key, body size, draining), body validation, the handlers. `AnthropicErrors`,
the outermost middleware, reshapes those on paths under `/v1/messages`, keeping the status and
the message: one place, so no error can escape in the other shape. On a stream the Messages
handler writes its own `error` event; the gate's cut-off of a draining server (an OpenAI
`data:` error and `[DONE]`) is rewritten there too.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferengine.entrypoints.openai.errors import error_body, internal_message
from inferengine.errors import InferEngineError

PATH = "/v1/messages"
# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def stream_error_event(exc: BaseException) -> str:
    """The `error` event that ends a Messages stream which failed after it started."""
    if isinstance(exc, InferEngineError):
        status = exc.status_code
        message = error_body(exc.message, exc.error_type, status)["error"]["message"]
    else:
        status, message = 500, internal_message(exc)
    return f"event: error\ndata: {json.dumps(anthropic_body(status, message))}\n\n"


def _reshaped(body: bytes, status: int) -> bytes:
    """An OpenAI-shaped error body in Anthropic's shape (its message kept)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace") or f"HTTP {status}"
    return json.dumps(anthropic_body(status, str(message))).encode()


def _reshaped_events(chunk: bytes) -> bytes:
    """The gate's end of a cut-off stream (`data: {"error": ...}`, `data: [DONE]`) as an
    Anthropic `error` event; the Messages stream's own events pass as they are."""
    out = []
    for event in chunk.split(b"\n\n"):
        if event.startswith(b"data: [DONE]"):
            continue
        if event.startswith(b'data: {"error"'):
            error = json.loads(event[len(b"data: ") :])["error"]
            status = 503 if error.get("code") in (503, None) else int(error["code"])
            body = json.dumps(anthropic_body(status, error.get("message", "")))
            out.append(f"event: error\ndata: {body}".encode())
        elif event:
            out.append(event)
    return b"".join(e + b"\n\n" for e in out)


class AnthropicErrors:
    """Pure ASGI: errors on paths under `/v1/messages` reshaped (see the module docstring)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path != PATH and not path.startswith(PATH + "/"):
            await self.app(scope, receive, send)
            return
        held: Message | None = None  # an error's response start, until its body is whole
        chunks: list[bytes] = []

        async def reshaping_send(message: Message) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=list(message.get("headers", [])))
                if message["status"] >= 400 and "json" in headers.get("content-type", ""):
                    held = message
                    return
                await send(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            if held is None:
                body = message.get("body", b"")
                if body.startswith(b"data: "):
                    message = {**message, "body": _reshaped_events(body)}
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = _reshaped(b"".join(chunks), held["status"])
            headers = MutableHeaders(raw=list(held.get("headers", [])))
            headers["content-length"] = str(len(body))
            await send({**held, "headers": headers.raw})
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, reshaping_send)
