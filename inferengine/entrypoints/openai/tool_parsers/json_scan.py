"""JSON read as a reply grows, each character once: where a value ends, whether what is written
so far can still be JSON, and the members of one object as they complete. A tool call's arguments
stream from it while the model writes them.

`JsonScanner` reads one value; `CallReader` reads a call written as an object, `{"name": ...,
"arguments": {...}}`; `ArgumentsReader` reads a call whose name is known from its arguments
object alone. Their decisions depend only on the text, never on how it was cut into pieces, so a
reply streamed in any pieces reads as the same calls as the whole reply.
"""

from __future__ import annotations

import json
import re
from enum import IntEnum

_SPACE = re.compile(r"[ \t\n\r]*")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters without escapes
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class Read(IntEnum):
    MORE = 0  # may go on: wait for more text
    DONE = 1  # the value (or call) is complete
    ERROR = 2  # the text cannot be JSON (JsonScanner) or is not a call (readers)
    BROKEN = 3  # a call that had started broke off (readers): it stays a call


# What the scanner expects next, outside a string, number or literal.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _NEXT = range(6)


class JsonScanner:
    """One JSON value from `start` (after any whitespace). `advance` reads what has arrived and
    stops at the end of the text, at the end of the value (DONE, `end` after it), at the first
    character that cannot belong (ERROR, at `pos`), or after a member of the outermost object
    completes (MORE: `members` has grown)."""

    def __init__(self, start: int):
        self.pos = start
        self.start = -1  # where the value begins (its first character)
        self.end = -1
        self.status = Read.MORE
        self.stack: list[str] = []  # the open "{" and "["
        self.expect = _VALUE
        self.token = ""  # "string", "number" or "literal" while one is read
        self.token_start = -1
        self.is_key = False
        self.escape = 0  # in a string: 1 after a backslash, 2..5 in the hex digits of \u
        self.escape_start = -1
        # The outermost object's members: (key, value start, value end), and the one being read.
        self.members: list[tuple[str, int, int]] = []
        self.key: str | None = None
        self.value_start = -1

    @property
    def safe(self) -> int:
        """The text before here is the beginning of some JSON value (a number, a literal or an
        escape that may not finish well is left out)."""
        if self.token in ("number", "literal"):
            return self.token_start
        if self.escape:
            return self.escape_start
        return self.pos

    def advance(self, text: str, final: bool = False) -> Read:
        count = len(self.members)
        while self.status is Read.MORE and len(self.members) == count:
            if self.pos >= len(text):
                if final and self.token == "number" and len(self.stack) == 0:
                    self._end_number(text)  # a bare number ends with the text
                break
            self._step(text)
        return self.status

    def _step(self, text: str) -> None:
        if self.token == "string":
            self._string(text)
        elif self.token == "number":
            if text[self.pos] in _NUMBER_CHARS:
                self.pos += 1
            else:
                self._end_number(text)
        elif self.token == "literal":
            word = _LITERALS[text[self.token_start]]
            if text[self.pos] != word[self.pos - self.token_start]:
                self.status = Read.ERROR
                return
            self.pos += 1
            if self.pos - self.token_start == len(word):
                self.token = ""
                self._value_done(self.pos)
        else:
            self._structure(text)

    def _string(self, text: str) -> None:
        c = text[self.pos]
        if self.escape == 1:
            if c not in _ESCAPES:
                self.status = Read.ERROR
                return
            self.escape = 2 if c == "u" else 0
        elif self.escape:
            if c not in _HEX:
                self.status = Read.ERROR
                return
            self.escape = 0 if self.escape == 5 else self.escape + 1
        elif c == "\\":
            self.escape, self.escape_start = 1, self.pos
        elif c == '"':
            self.pos += 1
            self.token = ""
            if not self.is_key:
                self._value_done(self.pos)
                return
            if len(self.stack) == 1:
                self.key = json.loads(text[self.token_start : self.pos])
            self.expect = _COLON
            return
        elif c < " ":
            self.status = Read.ERROR  # JSON strings hold no raw control characters
            return
        else:
            self.pos = _PLAIN.match(text, self.pos).end()  # type: ignore[union-attr]
            return
        self.pos += 1

    def _structure(self, text: str) -> None:
        self.pos = _SPACE.match(text, self.pos).end()  # type: ignore[union-attr]
        if self.pos >= len(text):
            return
        c, expect = text[self.pos], self.expect
        if expect in (_VALUE, _VALUE_OR_CLOSE) and not (expect == _VALUE_OR_CLOSE and c == "]"):
            self._begin_value(c)
        elif expect in (_KEY, _KEY_OR_CLOSE) and c == '"':
            self.token, self.token_start, self.is_key = "string", self.pos, True
            self.pos += 1
        elif expect == _COLON and c == ":":
            self.expect = _VALUE
            self.pos += 1
        elif expect == _NEXT and c == ",":
            self.expect = _KEY if self.stack[-1] == "{" else _VALUE
            self.pos += 1
        elif (c == "}" and expect in (_KEY_OR_CLOSE, _NEXT) and self.stack[-1] == "{") or (
            c == "]" and expect in (_VALUE_OR_CLOSE, _NEXT) and self.stack[-1] == "["
        ):
            self.stack.pop()
            self.pos += 1
            self._value_done(self.pos)
        else:
            self.status = Read.ERROR

    def _begin_value(self, c: str) -> None:
        if not self.stack:
            self.start = self.pos
        elif len(self.stack) == 1 and self.stack[0] == "{":
            self.value_start = self.pos
        if c in "{[":
            self.stack.append(c)
            self.expect = _KEY_OR_CLOSE if c == "{" else _VALUE_OR_CLOSE
            self.pos += 1
            return
        if c == '"':
            self.token, self.is_key = "string", False
        elif c == "-" or c.isdigit():
            self.token = "number"
        elif c in _LITERALS:
            self.token = "literal"
        else:
            self.status = Read.ERROR
            return
        self.token_start = self.pos
        self.pos += 1

    def _end_number(self, text: str) -> None:
        self.token = ""
        if _NUMBER.fullmatch(text, self.token_start, self.pos) is None:
            self.pos = self.token_start
            self.status = Read.ERROR
            return
        self._value_done(self.pos)

    def _value_done(self, end: int) -> None:
        if not self.stack:
            self.status, self.end = Read.DONE, end
            return
        if len(self.stack) == 1 and self.stack[0] == "{" and self.key is not None:
            self.members.append((self.key, self.value_start, end))
            self.key, self.value_start = None, -1
        self.expect = _NEXT


class ArgumentsReader:
    """A call named `name` whose arguments object starts at `start` (after any whitespace): a
    call from its opening brace on. `arguments` is what was written of them so far."""

    def __init__(self, start: int, name: str):
        self.scanner = JsonScanner(start)
        self.name = name
        self.arguments = ""
        self.started = False

    @property
    def pos(self) -> int:
        """Where reading stopped: after the object, or at the character that broke it."""
        return self.scanner.end if self.scanner.status is Read.DONE else self.scanner.pos

    def advance(self, text: str, final: bool) -> Read:
        scanner = self.scanner
        status = scanner.advance(text, final)
        while status is Read.MORE and scanner.pos < len(text):  # it paused after a member
            status = scanner.advance(text, final)
        if not self.started:
            if scanner.start < 0:
                if status is Read.ERROR or final:
                    return Read.ERROR
                return Read.MORE
            if text[scanner.start] != "{":
                return Read.ERROR
            self.started = True
        end = scanner.end if status is Read.DONE else scanner.safe
        self.arguments = text[scanner.start : end]
        if status is Read.MORE and final:
            return Read.BROKEN  # cut short
        return Read.BROKEN if status is Read.ERROR else status


class CallReader:
    """A call written as a JSON object holding its name and its arguments (an object, or the text
    of one, under the first of `argument_keys` written; missing: `{}`). It becomes a call
    (`started`) once its name and the opening brace of its arguments are read, or when the
    object closes; from then on it stays one, its arguments what was written of them, even if
    the text breaks off (BROKEN). Before that, text that cannot be such a call is an ERROR."""

    def __init__(self, start: int, argument_keys: tuple[str, ...]):
        self.scanner = JsonScanner(start)
        self.argument_keys = argument_keys
        self.name: str | None = None
        self.arguments = ""
        self.started = False
        self._arguments_done = False

    @property
    def pos(self) -> int:
        return self.scanner.end if self.scanner.status is Read.DONE else self.scanner.pos

    def advance(self, text: str, final: bool) -> Read:
        scanner = self.scanner
        while True:
            count = len(scanner.members)
            status = scanner.advance(text, final)
            if not self._read_members(text, count):
                return Read.ERROR
            if status is not Read.MORE or len(scanner.members) == count:
                break
        if scanner.start >= 0 and text[scanner.start] != "{":
            return Read.BROKEN if self.started else Read.ERROR
        if not self.started and self.name is not None:
            if scanner.key in self.argument_keys and scanner.value_start >= 0:
                if text[scanner.value_start] == "{":
                    self.started = True  # the arguments object has opened
            elif status is Read.DONE and not self._arguments_done:
                self.arguments, self._arguments_done = "{}", True
                self.started = True
        if self.started and not self._arguments_done:
            end = scanner.safe if scanner.value_start >= 0 else scanner.pos
            self.arguments = text[scanner.value_start : end]
        if status is Read.DONE:
            return Read.DONE if self.started else Read.ERROR
        if status is Read.ERROR or final:
            return Read.BROKEN if self.started else Read.ERROR
        return Read.MORE

    def _read_members(self, text: str, count: int) -> bool:
        """Take the name and arguments from the members completed since `count`; False when
        one shows this is not a call."""
        for key, start, end in self.scanner.members[count:]:
            if key == "name" and self.name is None:
                value = json.loads(text[start:end])
                if not isinstance(value, str) or not value:
                    return False
                self.name = value
                if self._arguments_done:
                    self.started = True  # the arguments came first
            elif key in self.argument_keys and not self._arguments_done:
                arguments = text[start:end]
                if text[start] == '"':  # the arguments as the text of an object
                    arguments = json.loads(arguments)
                    if not _is_object(arguments):
                        return False
                elif text[start] != "{":
                    return False
                self.arguments, self._arguments_done = arguments, True
                if self.name is not None:
                    self.started = True
        return True


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
