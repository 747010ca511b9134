"""Every error the server returns, in OpenAI's JSON shape `{"error": {message, type, param, code}}`.

`error_body` is the one way out for every error (responses, stream events, run-batch records): it
bounds the message and param, so that a client's value echoed in them (a huge regex, a model name,
an object key) comes back as a short excerpt, never as the megabytes it was sent as.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferengine.errors import InferEngineError, OverloadedError, excerpt
from inferengine.logger import init_logger

logger = init_logger(__name__)

RETRY_AFTER_S = "1"
MAX_MESSAGE_CHARS = 1000  # of an error message, whatever it echoes
MAX_PARAM_CHARS = 200
_MAX_LISTED_ERRORS = 5  # of a body's validation errors, in one message

# Error types for statuses that do not come from an `InferEngineError`.
_STATUS_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    503: "service_unavailable",
}


class ServiceUnavailableError(InferEngineError):
    """The server is starting, draining for shutdown, or otherwise not taking requests."""

    status_code = 503
    error_type = "service_unavailable"


def error_body(
    message: str, error_type: str, status: int, param: str | None = None, code: Any = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": excerpt(message, MAX_MESSAGE_CHARS),
            "type": error_type,
            "param": None if param is None else excerpt(param, MAX_PARAM_CHARS),
            "code": code if code is not None else status,
        }
    }


def _retry_headers(status: int) -> dict[str, str] | None:
    return {"Retry-After": RETRY_AFTER_S} if status == 503 else None


def error_response(exc: InferEngineError) -> JSONResponse:
    status = exc.status_code
    body = error_body(exc.message, exc.error_type, status, exc.param, exc.code)
    return JSONResponse(body, status_code=status, headers=_retry_headers(status))


def status_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    error_type = _STATUS_TYPES.get(status, "internal_error" if status >= 500 else "error")
    body = error_body(message, error_type, status, param)
    return JSONResponse(body, status_code=status, headers=_retry_headers(status))


def stream_error_event(exc: BaseException) -> str:
    """The last SSE event of a stream that failed after it started."""
    if isinstance(exc, InferEngineError):
        body = error_body(exc.message, exc.error_type, exc.status_code, exc.param, exc.code)
    else:
        body = error_body(internal_message(exc), "internal_error", 500)
    return f"data: {json.dumps(body)}\n\n"


def internal_message(exc: BaseException) -> str:
    return f"internal error: {type(exc).__name__}: {excerpt(str(exc))}"


def log_internal_error(where: str, exc: BaseException) -> None:
    """A bug, logged with its traceback but only an excerpt of its message (which may quote a
    client's value)."""
    frames = "".join(traceback.format_tb(exc.__traceback__))
    logger.error(
        "internal error %s: %s\nTraceback (most recent call last):\n%s",
        where,
        internal_message(exc),
        frames.rstrip(),
    )


def internal_error_response(path: str, exc: BaseException) -> JSONResponse:
    """The 500 for a bug, logged once."""
    log_internal_error(f"on {excerpt(path)}", exc)
    return status_response(500, internal_message(exc))


def validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """What is wrong with a body (its first few errors) and the top-level field to name."""
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return _json_message(errors[0], getattr(exc, "body", None)), None
    parts, param = [], None
    for err in errors[:_MAX_LISTED_ERRORS]:
        loc = [excerpt(str(x), 64) for x in err.get("loc", ()) if x != "body"]
        if loc and param is None:
            param = loc[0]
        where = ".".join(loc) or "body"
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {excerpt(message)}")
    if len(errors) > _MAX_LISTED_ERRORS:
        parts.append(f"and {len(errors) - _MAX_LISTED_ERRORS} more error(s)")
    return "; ".join(parts) or "invalid request body", param


def _json_message(err: Any, doc: Any) -> str:
    """Where a body that is not JSON goes wrong: "Invalid JSON body: <what> at line L column C"."""
    what = str((err.get("ctx") or {}).get("error") or "not JSON")
    loc = err.get("loc", ())
    pos = loc[-1] if loc and isinstance(loc[-1], int) else None
    if pos is None or not isinstance(doc, str):
        return f"Invalid JSON body: {what}."
    line = doc.count("\n", 0, pos) + 1
    column = pos - doc.rfind("\n", 0, pos)
    return f"Invalid JSON body: {what} at line {line} column {column} (character {pos})."


def _parse_failure(cause: BaseException) -> str:
    if isinstance(cause, RecursionError):
        return "its arrays or objects are nested too deeply"
    return str(cause).split(";")[0]  # e.g. an integer of more digits than Python converts


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InferEngineError)
    async def _engine_error(request: Request, exc: InferEngineError) -> JSONResponse:
        if isinstance(exc, OverloadedError):
            logger.warning("rejected %s: %s", request.url.path, exc.message)
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return status_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        cause = exc.__cause__
        if exc.status_code == 400 and isinstance(cause, RecursionError | ValueError):
            # A body FastAPI's JSON parser gave up on, beyond a syntax error: say why.
            return status_response(400, f"Invalid JSON body: {_parse_failure(cause)}.")
        return status_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return internal_error_response(request.url.path, exc)
