"""What every tool-call parser shares: the `scan` contract, the content rule, and streaming.

A parser reads a model's text as text outside tool calls plus the calls, in order. `scan(text,
final)` returns both; while the text may still grow (`final` false) it stops before anything that
could yet become, or is still completing, a call, so what it returns is a prefix of what any
longer text gives. Streaming then sends only what no later token can take back, and the
reassembled stream equals the whole reply by construction.
"""

from __future__ import annotations

import abc
import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, ClassVar

from inferengine.logger import init_logger

logger = init_logger(__name__)

_ALPHANUMERIC = string.ascii_letters + string.digits
DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


def random_alphanumeric(length: int) -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(length))


def make_call_id() -> str:
    """An id in OpenAI's shape, `call_` and 24 letters or digits."""
    return "call_" + random_alphanumeric(24)


def content_of(outside: str, calls: list[Any], final: bool) -> str | None:
    """The reply's content from the text outside calls: without its trailing whitespace when
    there are calls (or may yet be: not final), None when empty."""
    if calls or not final:
        outside = outside.rstrip()
    return outside or None


def partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of one of `tags` (and shorter
    than it): text that a later token may complete into a tag."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def call_from(obj: Any, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call from a decoded `{"name": ..., <argument key>: {...}}`; None if it is not one.
    Arguments may be an object or the text of one; missing arguments are `{}`."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


class ToolParser(abc.ABC):
    """Base class; a subclass sets `name` and implements `scan`."""

    name: ClassVar[str] = ""
    # Its tags are special tokens, so the reply is decoded with them (skip_special_tokens off).
    keeps_special_tokens: ClassVar[bool] = False

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The text outside tool calls, and the calls (see the module docstring)."""

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole reply: its content (None if none) and its calls. A call whose text does not
        parse stays in the content as written."""
        outside, calls = self.scan(text, final=True)
        return content_of(outside, calls, final=True), calls

    def make_call_id(self) -> str:
        return make_call_id()

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return ToolCallStream(self, max_calls)


class ToolCallStream:
    """One streamed choice: `feed` each text delta, get the content to send and the calls that
    completed. Content streams as soon as it cannot be part of a call; a call is sent whole, once
    its text closes (its arguments are not streamed piecewise)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.sent_content = ""
        self.num_sent_calls = 0

    def feed(self, delta: str, final: bool) -> tuple[str, list[ParsedCall]]:
        self.text += delta
        outside, calls = self.parser.scan(self.text, final)
        calls = calls[: self.max_calls]
        content = content_of(outside, calls, final) or ""
        if not content.startswith(self.sent_content):  # a parser broke the scan contract
            logger.warning("%s tool parser: streamed content was taken back", self.parser.name)
        new_content = content[len(self.sent_content) :]
        self.sent_content = content
        new_calls = calls[self.num_sent_calls :]
        self.num_sent_calls = len(calls)
        return new_content, new_calls
