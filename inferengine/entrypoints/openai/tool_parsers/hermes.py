"""`hermes`: Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`; text around the blocks is content. A block that is not a call
stays in the content as written; text after a call inside its block is dropped."""

from __future__ import annotations

import json
from typing import Any

from inferengine.entrypoints.openai.tool_parsers.base import (
    ToolCallStream,
    ToolParser,
    calls_grammar,
    lark_json,
    lark_string,
    lark_token,
    skip_space,
)
from inferengine.entrypoints.openai.tool_parsers.json_scan import CallReader, Read

START, END = "<tool_call>", "</tool_call>"
_CONTENT, _CALL, _CLOSE, _SKIP, _NOT_A_CALL = range(5)


class HermesStream(ToolCallStream):
    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.state = _CONTENT
        self.block = 0  # where the block being read starts

    def step(self, final: bool) -> bool:
        text = self.text
        if self.state == _CONTENT:
            at = self.content_until(START, final)
            if at is None:
                return False
            self.block, self.state = at, _CALL
            self.begin_call(CallReader(self.pos, ("arguments", "parameters")))
            return True
        if self.state == _CALL:
            status = self.read(final)
            if status is Read.MORE:
                return False
            self.state = {Read.DONE: _CLOSE, Read.BROKEN: _SKIP, Read.ERROR: _NOT_A_CALL}[status]
            return True
        if self.state == _CLOSE:  # after a call: whitespace, then </tool_call>
            p = skip_space(text, self.pos)
            if text.startswith(END, p):
                self.pos, self.state = p + len(END), _CONTENT
                return True
            if p == len(text) or (not final and END.startswith(text[p:])):
                return False  # an unclosed block at the end of the reply is still a call
            self.state = _SKIP
            return True
        at = text.find(END, self.pos)
        if at < 0 and not final:
            return False
        end = len(text) if at < 0 else at + len(END)
        if self.state == _SKIP:
            self.drop(len(text) if at < 0 else at, "after a call in its <tool_call> block")
            self.pos = end
        else:  # kept as written
            self.pos = self.block
            self.take(end)
        self.state = _CONTENT
        return True


class HermesToolParser(ToolParser):
    name = "hermes"
    stream_class = HermesStream

    def strict_grammar(
        self, tools: list[tuple[str, dict[str, Any]]], tokenizer: Any, answer: str | None = None
    ) -> str:
        # As the Hermes and Qwen templates write a call (vLLM's two forms: with and without
        # the newlines).
        calls = " | ".join(
            lark_string(json.dumps(name, ensure_ascii=False) + ', "arguments": ')
            + " "
            + lark_json(schema)
            for name, schema in tools
        )
        end = lark_token(tokenizer, END)
        return calls_grammar(
            tokenizer,
            START,
            f'"\\n"? "{{\\"name\\": " ({calls}) "}}" "\\n"? {end}',
            answer=answer,
        )
