"""Every error the server returns, in OpenAI's JSON shape `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from inferengine.errors import InferEngineError, OverloadedError
from inferengine.logger import init_logger

logger = init_logger(__name__)

RETRY_AFTER_S = "1"

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


class RequestTooLargeError(InferEngineError):
    status_code = 413
    error_type = "request_too_large"


def error_body(
    message: str, error_type: str, status: int, param: str | None = None, code: Any = None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": error_type,
            "param": param,
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
        body = error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error", 500)
    return f"data: {json.dumps(body)}\n\n"


def validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if loc and param is None:
            param = loc[0]
        where = ".".join(loc) or "body"
        message = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {message}")
    return "; ".join(parts) or "invalid request body", param


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
        return status_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s", request.url.path)
        return status_response(500, f"internal error: {type(exc).__name__}: {exc}")
