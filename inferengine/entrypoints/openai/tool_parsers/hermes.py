"""`hermes`: Hermes 2 Pro, Qwen2.5 and Qwen3 write each call as `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>`; text around the blocks is content."""

from __future__ import annotations

import json

from inferengine.entrypoints.openai.tool_parsers.base import (
    ParsedCall,
    ToolParser,
    call_from,
    partial_tag_len,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        outside: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                tail = text[pos:]
                outside.append(
                    tail if final else tail[: len(tail) - partial_tag_len(tail, (START,))]
                )
                return "".join(outside), calls
            outside.append(text[pos:start])
            end = text.find(END, start + len(START))
            if end < 0 and not final:
                return "".join(outside), calls  # the block may still close
            # An unclosed block at the end still counts when its JSON is whole.
            body_end, after = (len(text), len(text)) if end < 0 else (end, end + len(END))
            call = _parse(text[start + len(START) : body_end])
            if call is None:
                outside.append(text[start:after])  # kept as written
            else:
                calls.append(call)
            pos = after


def _parse(body: str) -> ParsedCall | None:
    try:
        return call_from(json.loads(body), ("arguments", "parameters"))
    except ValueError:
        return None
