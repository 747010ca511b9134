"""What every tool-call parser shares: the stream that reads a reply as it grows, the content rule,
and the strict-tools grammar's common parts.

A parser reads a model's text as text outside tool calls (the content) plus the calls, in order.
Each parser is a `ToolCallStream` subclass: `feed` takes the next piece of text and returns the
content and call pieces that no later text can take back. A call is sent as soon as its name and
the start of its arguments are read (its first delta: name, empty arguments), then its arguments
piece by piece as they are written. A whole reply is read by feeding it in one piece, so a
reassembled stream equals the whole reply by construction, however the text was cut.

Once a call has started it stays a call: if its text then breaks off (the reply is cut short, or
it stops being JSON), the call keeps the arguments written so far. Text that breaks before a call
has started stays in the content as written.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass
from typing import Any, ClassVar

from inferengine.entrypoints.openai.tool_parsers.json_scan import (
    ArgumentsReader,
    CallReader,
    Read,
)
from inferengine.logger import init_logger

logger = init_logger(__name__)

_ALPHANUMERIC = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as written


@dataclass(frozen=True)
class CallDelta:
    """What one `feed` adds to one call: its first delta has the name, later ones only
    argument text."""

    index: int
    name: str | None
    arguments: str


@dataclass
class StreamedCall:
    name: str
    arguments: str = ""


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


class ToolCallStream:
    """One reply read as it grows. A subclass implements `step`: read on from `pos`, moving text
    into the content (`take`), starting and growing calls (`read`), and return whether it made
    progress (False: it waits for more text, or, `final`, is done)."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.text = ""
        self.pos = 0  # what is read; text past it is not decided yet
        self.outside = ""  # the text outside calls, so far
        self.calls: list[StreamedCall] = []
        self._sent_content = ""
        self._sent_arguments: list[int] = []
        self._reader: CallReader | ArgumentsReader | None = None
        self._call: StreamedCall | None = None  # the reader's call, once started

    def feed(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The content and the call pieces that `delta` (the next text) adds; `final`: it is
        the last piece."""
        self.text += delta
        while self.step(final):
            pass
        calls = self.calls[: self.max_calls]
        content = content_of(self.outside, calls, final) or ""
        if not content.startswith(self._sent_content):  # a parser broke the stream contract
            logger.warning("%s tool parser: streamed content was taken back", type(self).__name__)
        new_content = content[len(self._sent_content) :]
        self._sent_content = content
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self._sent_arguments):
                deltas.append(CallDelta(i, call.name, call.arguments))
                self._sent_arguments.append(len(call.arguments))
            elif len(call.arguments) > self._sent_arguments[i]:
                deltas.append(CallDelta(i, None, call.arguments[self._sent_arguments[i] :]))
                self._sent_arguments[i] = len(call.arguments)
        return new_content, deltas

    def step(self, final: bool) -> bool:
        raise NotImplementedError

    # ---- for subclasses ----------------------------------------------------------------------

    def take(self, end: int) -> None:
        """The text from `pos` to `end` is content."""
        self.outside += self.text[self.pos : end]
        self.pos = max(self.pos, end)

    def content_until(self, tag: str, final: bool) -> int | None:
        """Content up to `tag` (a partial tag at the end is held back unless `final`): where the
        tag starts, with `pos` after it, or None if it has not come."""
        at = self.text.find(tag, self.pos)
        if at < 0:
            held = 0 if final else partial_tag_len(self.text[self.pos :], (tag,))
            self.take(len(self.text) - held)
            return None
        self.take(at)
        self.pos = at + len(tag)
        return at

    def drop(self, end: int, why: str) -> None:
        """The text from `pos` to `end` is neither content nor a call (logged)."""
        if self.text[self.pos : end].strip():
            logger.warning("tool call parser: dropped %.200r (%s)", self.text[self.pos : end], why)
        self.pos = end

    def begin_call(self, reader: CallReader | ArgumentsReader) -> None:
        self._reader, self._call = reader, None

    def read(self, final: bool) -> Read:
        """Go on with the call begun with `begin_call`: DONE (`pos` after it), BROKEN (a call
        that broke off; `pos` where it broke), ERROR (not a call; `pos` unmoved) or MORE."""
        reader = self._reader
        assert reader is not None
        status = reader.advance(self.text, final)
        if reader.started:
            if self._call is None:
                self._call = StreamedCall(reader.name or "")
                self.calls.append(self._call)
            self._call.arguments = reader.arguments
        if status in (Read.DONE, Read.BROKEN):
            self.pos = reader.pos
            if status is Read.BROKEN and not final:
                logger.warning(
                    "tool call parser: a call broke off at %.200r", self.text[self.pos :]
                )
        if status is not Read.MORE:
            self._reader = None
        return status


class ToolParser:
    """Base class; a subclass sets `name` and `stream_class`."""

    name: ClassVar[str] = ""
    stream_class: ClassVar[type[ToolCallStream]] = ToolCallStream
    # Its tags are special tokens, so the reply is decoded with them (skip_special_tokens off).
    keeps_special_tokens: ClassVar[bool] = False

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole reply: its content (None if none) and its calls."""
        stream = self.stream()
        content, deltas = stream.feed(text, final=True)
        calls = [ParsedCall(d.name or "", d.arguments) for d in deltas]
        return content or None, calls

    def make_call_id(self) -> str:
        return make_call_id()

    def stream(self, max_calls: int | None = None) -> ToolCallStream:
        return self.stream_class(max_calls)

    def strict_grammar(
        self, tools: list[tuple[str, dict[str, Any]]], tokenizer: Any, answer: str | None = None
    ) -> str | None:
        """A Lark grammar (llguidance's) that leaves the reply free but holds each call this
        parser reads to one of `tools` (name, arguments schema): tool_choice "auto" with
        `strict` tools. With `answer` (the name of another grammar beside it, as the request's
        `response_format`), the reply is either that grammar's or only calls (`calls_grammar`).
        None when this parser has none."""
        return None


def _json_text(value: Any) -> str:
    # "::=" would make the grammar read as GBNF (structured_output.grammar); it can only be
    # inside a string here, where an escaped ":" means the same.
    return json.dumps(value, ensure_ascii=False).replace("::=", ":\\u003a=")


def lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return _json_text(text)


def lark_json(schema: dict[str, Any], spaced: bool = False) -> str:
    """`schema` as an llguidance `%json` item, whitespace as the model likes it; `spaced`: as
    `json.dumps` writes it (`": "` and `", "`, no other whitespace), which keeps it in one
    lexer with a JSON answer (compact JSON: no whitespace either)."""
    if spaced:
        options = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
        schema = {**schema, "x-guidance": options}
    return "%json " + _json_text(schema)


def lark_token(tokenizer: Any, text: str) -> str:
    """How a Lark grammar spells `text`: the special token it is (by id), the token of its own
    that is not special (Qwen's `<tool_call>`) or the string, or the string."""
    token, string = _token_forms(tokenizer, text)
    if token is None or string is None:
        return token or string or ""
    return f"({token} | {string})"


def _token_forms(tokenizer: Any, text: str) -> tuple[str | None, str | None]:
    """`text` as a Lark token (by id) and as a Lark string, each None where it cannot be
    written so. llguidance counts every added token as special, one no string can spell, so a
    token of its own that is not special is both: the model's token and the string in
    pieces."""
    token_id = tokenizer.convert_tokens_to_ids(text)
    added = getattr(tokenizer, "added_tokens_decoder", {}).get(token_id)
    if (
        isinstance(token_id, int)
        and tokenizer.convert_ids_to_tokens(token_id) == text
        and added is not None
    ):
        return f"<[{token_id}]>", None if added.special else lark_string(text)
    return None, lark_string(text)


def calls_grammar(
    tokenizer: Any,
    tag: str | None,
    call: str,
    rules: str = "",
    answer: str | None = None,
    separator: str = "",
) -> str:
    """The Lark grammar of a reply with calls in it, each `tag` then `call` (and further
    `rules`).

    Without `answer`: free text with calls in it. A tag that is a token of its own is one the
    text cannot hold; a tag that is text ends the free text lazily, as soon as it is written.

    With `answer`, the name of another grammar of the same llguidance grammar list: either
    that grammar's reply (`@answer`) or only calls, with whitespace and `separator` (a Lark
    item) between them and whitespace after them; `tag` may then be None (`call` says how a
    call starts). llguidance lexes a grammar it names apart: where a call and the answer may
    begin with the same text, its lexer takes one side only (the reply stays valid, the other
    side is lost), unless the call is JSON as the answer is (`%json` items without whitespace
    between tokens share one lexer).
    """
    if answer is not None:
        head = "" if tag is None else lark_token(tokenizer, tag) + " "
        between = f"WS? {separator} WS?" if separator else "WS?"
        return (
            f"%llguidance {{}}\nstart: @{answer} | call ({between} call)* WS?\n"
            f"WS: /[ \\t\\r\\n]+/\ncall: {head}{call}\n{rules}"
        )
    assert tag is not None
    token, string = _token_forms(tokenizer, tag)
    heads = [] if token is None else [f"TEXT {token}"]
    if string is not None:
        rules = f"trigger[lazy]: TEXT {string}\n" + rules
        heads.append("trigger")
    return (
        "%llguidance {}\nstart: call* TEXT\nTEXT: /(.|\\n)*/\n"
        f"call: ({' | '.join(heads)}) {call}\n{rules}"
    )
