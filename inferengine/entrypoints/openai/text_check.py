"""Request text that is not Unicode, refused where it comes in with a 400 that names the field.

A JSON string may spell a lone UTF-16 surrogate (`"\\ud800"`); Python decodes it, but nothing
downstream can encode it (the tokenizer, UTF-8 logs, the engine's msgpack), so it would fail
deep inside a request. The server's gate checks every body with `body_problem`; run-batch checks
each parsed row with `lone_surrogate_path`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from inferengine.errors import InvalidRequestError, excerpt

# A JSON escape of a surrogate code point, \uD800 to \uDFFF (a pair is fine; only a lone one is
# refused, which needs the parsed value to tell).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_KEY_CHARS = 64  # of a client's object key in a field's path


def body_problem(body: bytes) -> InvalidRequestError | None:
    """Why a request body is not text (invalid UTF-8, or a lone surrogate in a JSON string or
    key); None when it is text, or is not JSON at all (the route then says what is wrong)."""
    try:
        if not body.isascii():  # (ASCII is UTF-8; most bodies are, and need no decoding)
            body.decode("utf-8")
    except UnicodeDecodeError as e:
        return InvalidRequestError(
            f"The request body is not valid UTF-8 (byte {e.start}: {e.reason}); send JSON "
            "encoded as UTF-8."
        )
    if _SURROGATE_ESCAPE.search(body) is None:
        return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested too deep: the route says so
        return None
    path = lone_surrogate_path(value)
    return None if path is None else lone_surrogate_error(path)


def lone_surrogate_error(path: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{path} holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair), "
        "which is not Unicode text; send each surrogate pair whole, or the character itself.",
        param=path,
    )


def lone_surrogate_path(value: Any) -> str | None:
    """Where in a parsed JSON value the first string or object key holding a lone surrogate is,
    e.g. `messages[0].content` ("body" for a top-level string); None when there is none."""
    # (value, its parent's entry, its key or index): paths are spelled only for the one found.
    stack: list[tuple[Any, Any, str | int | None]] = [(value, None, None)]
    while stack:
        entry = stack.pop()
        item = entry[0]
        if isinstance(item, str):
            if _has_surrogate(item):
                return _path(entry)
        elif isinstance(item, dict):
            children = []
            for key, child in item.items():
                if isinstance(key, str) and _has_surrogate(key):
                    return _path((key, entry, key))
                if isinstance(child, str | dict | list):
                    children.append((child, entry, key))
            stack.extend(reversed(children))
        elif isinstance(item, list):
            for i in range(len(item) - 1, -1, -1):
                if isinstance(item[i], str | dict | list):
                    stack.append((item[i], entry, i))
    return None


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


def _path(entry: tuple[Any, Any, str | int | None]) -> str:
    parts: list[str] = []
    while entry[1] is not None:
        key = entry[2]
        parts.append(f"[{key}]" if isinstance(key, int) else f".{excerpt(str(key), _KEY_CHARS)}")
        entry = entry[1]
    return "".join(reversed(parts)).removeprefix(".") or "body"
