"""Errors a user can cause, each with a message that says what to do, and its HTTP mapping;
`excerpt`, the bounded form in which a client's value may be echoed in an error or a log line."""

from __future__ import annotations

EXCERPT_CHARS = 200  # of a client's value, in an error message or a log line


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """`text` (a client's value) safe to echo: lone surrogates escaped (they cannot be encoded
    as UTF-8), and when longer than `limit` characters, its start, an ellipsis and its length."""
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(text)} characters in all)"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class InferEngineError(Exception):
    """Base class. `status_code` and `error_type` give the OpenAI-shaped HTTP error."""

    status_code: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(InferEngineError, ValueError):
    """A request parameter or prompt the engine cannot serve as given."""

    status_code = 400
    error_type = "invalid_request_error"


class ConfigError(InferEngineError, ValueError):
    """An engine setting (CLI flag or `LLM(...)` argument) that cannot work."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelLoadError(InferEngineError):
    """The model could not be found, read or understood."""

    status_code = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(InferEngineError):
    """The request named a model this server does not serve."""

    status_code = 404
    error_type = "not_found_error"


class OverloadedError(InferEngineError):
    """The waiting queue is full; the client should retry later."""

    status_code = 503
    error_type = "overloaded_error"


class EngineDeadError(InferEngineError):
    """The engine core stopped; in-flight and new requests cannot finish."""

    status_code = 503
    error_type = "engine_dead_error"
