"""`llama3_json`: Llama 3.1/3.2/3.3 answer a call with only JSON, `{"name": ..., "parameters":
{...}}` (or "arguments"), maybe after `<|python_tag|>`, several separated by `;`. JSON at the start
of the reply is read as calls; text before `<|python_tag|>` is content."""

from __future__ import annotations

import json

from inferengine.entrypoints.openai.tool_parsers.base import (
    DECODER,
    ParsedCall,
    ToolParser,
    call_from,
    partial_tag_len,
    skip_space,
)

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        lead = skip_space(text, 0)
        if text.startswith("{", lead):
            head, start = text[:lead], lead
        elif (at := text.find(TAG)) >= 0:
            head, start = text[:at], at + len(TAG)
        elif final:
            return text, []
        elif lead == len(text):
            return "", []  # only whitespace yet: JSON may follow
        else:
            return text[: len(text) - partial_tag_len(text, (TAG,))], []
        region = len(head)  # where the calls' text begins (the tag, or the first brace)
        calls: list[ParsedCall] = []
        pos = start
        while True:
            pos = skip_space(text, pos)
            if calls and text.startswith(";", pos):
                pos = skip_space(text, pos + 1)
            elif calls and pos < len(text):
                break  # no separator: the rest is content
            if pos == len(text):
                return head, calls
            if text[pos] != "{":
                break
            try:
                obj, end = DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                if not final:
                    return head, calls  # maybe not written to its end yet
                break
            call = call_from(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            pos = end
        return head + text[pos if calls else region :], calls
