"""`mistral`: Mistral 7B Instruct v0.3 writes `[TOOL_CALLS][{"name": ..., "arguments": {...}},
...]`; tokenizers from v11 on (Mistral Small 3.1+, Ministral, Devstral) write one call per tag,
`[TOOL_CALLS]name[ARGS]{...}`, maybe with the call's id, `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`
(as their templates render earlier calls), or older ones `[TOOL_CALLS]name{...}`. Text before and
between the calls is content, and so is text after a call that broke off. `[TOOL_CALLS]` is a
special token, so replies are decoded with special tokens. Call ids are 9 letters or digits, as
Mistral's templates require; ids the model writes are not kept (it may repeat an earlier one)."""

from __future__ import annotations

import json
import re
from typing import Any

from inferengine.entrypoints.openai.tool_parsers.base import (
    ToolCallStream,
    ToolParser,
    calls_grammar,
    lark_json,
    lark_string,
    lark_token,
    random_alphanumeric,
    skip_space,
)
from inferengine.entrypoints.openai.tool_parsers.json_scan import (
    ArgumentsReader,
    CallReader,
    Read,
)

TAG = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
_ID = re.compile(r"[A-Za-z0-9_\-]*")
_CONTENT, _AFTER_TAG, _ITEMS, _ITEM, _NAMED, _ARGUMENTS = range(6)


class MistralStream(ToolCallStream):
    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.state = _CONTENT
        self.tag = 0  # where the tag being read starts
        self.num_items = 0  # calls read from the JSON list after the tag
        self.item_at = 0

    def step(self, final: bool) -> bool:
        text = self.text
        if self.state == _CONTENT:
            at = self.content_until(TAG, final)
            if at is None:
                return False
            self.tag, self.state = at, _AFTER_TAG
            return True
        if self.state == _AFTER_TAG:
            p = skip_space(text, self.pos)
            if p == len(text):
                return self._not_a_call(p) if final else False
            if text[p] == "[":
                self.pos, self.state, self.num_items = p + 1, _ITEMS, 0
            else:
                self.pos, self.state = p, _NAMED
            return True
        if self.state == _ITEMS:
            return self._items(final)
        if self.state == _NAMED:
            return self._named(final)
        status = self.read(final)  # _ITEM or _ARGUMENTS
        if status is Read.MORE:
            return False
        if self.state == _ITEM:
            if status is Read.DONE:
                self.num_items += 1
                self.state = _ITEMS
                return True
            if status is Read.ERROR:
                if not self.num_items:
                    return self._not_a_call(self.item_at)
                self.pos = self.item_at
        self.state = _CONTENT  # after the call, or where it broke off: text again
        return True

    def _items(self, final: bool) -> bool:
        """In the JSON list: the next call, a comma, or the closing bracket."""
        text = self.text
        p = skip_space(text, self.pos)
        if self.num_items and text.startswith(",", p):
            p = skip_space(text, p + 1)
        elif self.num_items and text.startswith("]", p):
            self.pos, self.state = p + 1, _CONTENT
            return True
        if p == len(text):
            if final:
                self.state = _CONTENT
                return self._not_a_call(p) if not self.num_items else True
            return False
        if text[p] != "{":
            if not self.num_items:
                return self._not_a_call(p)
            self.pos, self.state = p, _CONTENT
            return True
        self.begin_call(CallReader(p, ("arguments", "parameters")))
        self.item_at, self.state = p, _ITEM
        return True

    def _named(self, final: bool) -> bool:
        """`name[CALL_ID]id[ARGS]{...}`, the middle parts optional."""
        text = self.text
        name = _NAME.match(text, self.pos)
        if name is None:
            return self._not_a_call(self.pos)
        p = name.end()
        if not final and p == len(text):
            return False  # the name may go on
        if text.startswith(CALL_ID, p):
            p = _ID.match(text, p + len(CALL_ID)).end()  # type: ignore[union-attr]
            if not final and p == len(text):
                return False
            if not text.startswith(ARGS, p) and (final or not ARGS.startswith(text[p:])):
                return self._not_a_call(p)
        rest = text[p : p + len(CALL_ID)]
        if (
            not final
            and len(rest) < len(CALL_ID)
            and (CALL_ID.startswith(rest) or ARGS.startswith(rest))
        ):
            return False  # a marker may follow
        if text.startswith(ARGS, p):
            p += len(ARGS)
        if p == len(text):
            return self._not_a_call(p) if final else False
        if text[p] != "{":
            return self._not_a_call(p)
        self.begin_call(ArgumentsReader(p, name.group()))
        self.state = _ARGUMENTS
        return True

    def _not_a_call(self, end: int) -> bool:
        """The tag and what follows it up to `end` are content, as written."""
        self.pos = self.tag
        self.take(end)
        self.state = _CONTENT
        return True


class MistralToolParser(ToolParser):
    name = "mistral"
    stream_class = MistralStream
    keeps_special_tokens = True

    def make_call_id(self) -> str:
        return random_alphanumeric(9)

    def strict_grammar(
        self, tools: list[tuple[str, dict[str, Any]]], tokenizer: Any, answer: str | None = None
    ) -> str:
        # The form this tokenizer's models write: with an [ARGS] token, one call per tag.
        args = lark_token(tokenizer, ARGS)
        if args.startswith("<["):
            call_id = lark_token(tokenizer, CALL_ID)
            maybe_id = f"({call_id} /[A-Za-z0-9]+/)? " if call_id.startswith("<[") else ""
            calls = " | ".join(
                f"{lark_string(name)} {maybe_id}{args} {lark_json(schema)}"
                for name, schema in tools
            )
            return calls_grammar(tokenizer, TAG, f"({calls})", answer=answer)
        items = " | ".join(
            lark_string('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
            + f" {lark_json(schema)}"
            for name, schema in tools
        )
        return calls_grammar(
            tokenizer, TAG, '"[" item (", " item)* "]"', f'item: ({items}) "}}"\n', answer=answer
        )
