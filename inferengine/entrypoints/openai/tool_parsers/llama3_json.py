"""`llama3_json`: Llama 3.1/3.2/3.3 answer a call with only JSON, `{"name": ..., "parameters":
{...}}` (or "arguments"), maybe after `<|python_tag|>`, several separated by `;`. JSON at the start
of the reply is read as calls; text before `<|python_tag|>` is content, and so is text after the
calls (or after a call that broke off)."""

from __future__ import annotations

import json
from typing import Any

from inferengine.entrypoints.openai.tool_parsers.base import (
    ToolCallStream,
    ToolParser,
    calls_grammar,
    lark_json,
    lark_string,
    skip_space,
)
from inferengine.entrypoints.openai.tool_parsers.json_scan import CallReader, Read

TAG = "<|python_tag|>"
_TRIGGER = '{"name": "'
# Keys that only mean something at the root of a schema.
_ROOT_ONLY = ("$schema", "$id")
_START, _CONTENT, _CALLS, _CALL, _REST = range(5)


class Llama3JsonStream(ToolCallStream):
    def __init__(self, max_calls: int | None = None):
        super().__init__(max_calls)
        self.state = _START
        self.region = 0  # where the calls' text begins (the tag, or the first brace)
        self.num_calls = 0
        self.call_at = 0  # where the call being read starts

    def step(self, final: bool) -> bool:
        text = self.text
        if self.state == _START:
            lead = skip_space(text, 0)
            if lead == len(text):
                if final:
                    self.take(lead)
                return False  # only whitespace yet: JSON may follow
            if text[lead] == "{":
                self.take(lead)
                self.region, self.state = lead, _CALLS
            else:
                self.state = _CONTENT
            return True
        if self.state == _CONTENT:
            at = self.content_until(TAG, final)
            if at is None:
                return False
            self.region, self.state = at, _CALLS
            return True
        if self.state == _CALLS:
            p = skip_space(text, self.pos)
            if self.num_calls and text.startswith(";", p):
                p = skip_space(text, p + 1)
            elif self.num_calls and p < len(text):
                self.pos, self.state = p, _REST  # no separator: the rest is content
                return True
            if p == len(text):
                return False
            if text[p] != "{":
                self._not_calls(p)
                return True
            self.begin_call(CallReader(p, ("parameters", "arguments")))
            self.call_at, self.state = p, _CALL
            return True
        if self.state == _CALL:
            status = self.read(final)
            if status is Read.MORE:
                return False
            if status is Read.DONE:
                self.num_calls += 1
                self.state = _CALLS
            elif status is Read.BROKEN:
                self.num_calls += 1
                self.state = _REST
            else:
                self._not_calls(self.call_at)
            return True
        self.take(len(text))
        return False

    def _not_calls(self, pos: int) -> None:
        """Text that is not a call: after calls, it and the rest are content; before any, the
        whole region is."""
        self.pos = pos if self.num_calls else self.region
        self.state = _REST


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    stream_class = Llama3JsonStream

    def strict_grammar(
        self, tools: list[tuple[str, dict[str, Any]]], tokenizer: Any, answer: str | None = None
    ) -> str:
        if answer is not None:
            # A call is JSON as the answer may be: both must be JSON of one lexer (base.py).
            calls = " | ".join(lark_json(_call_schema(n, s), spaced=True) for n, s in tools)
            return calls_grammar(tokenizer, None, f"({calls})", answer=answer, separator='";"')
        # As Llama 3's template writes a call; the grammar starts at `{"name": "`.
        calls = " | ".join(
            lark_string(json.dumps(name, ensure_ascii=False)[1:] + ', "parameters": ')
            + " "
            + lark_json(schema)
            for name, schema in tools
        )
        return calls_grammar(tokenizer, _TRIGGER, f'({calls}) "}}"')


def _call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of a call to `name`, `{"name": ..., "parameters": ...}`; the parameters'
    definitions move to the root, where their references point."""
    parameters = {k: v for k, v in parameters.items() if k not in _ROOT_ONLY}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": {"const": name}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    for key in ("$defs", "definitions"):
        if key in parameters:
            schema[key] = parameters.pop(key)
    return schema
