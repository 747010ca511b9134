"""`mistral`: Mistral 7B Instruct v0.3 and later write `[TOOL_CALLS][{"name": ..., "arguments":
{...}}, ...]` (newer tokenizers: `[TOOL_CALLS]name{...}` or `[TOOL_CALLS]name[ARGS]{...}`, one
call per tag); text before the tag is content. `[TOOL_CALLS]` is a special token, so replies are
decoded with special tokens. Call ids are 9 letters or digits, as Mistral's templates require."""

from __future__ import annotations

import json
import re

from inferengine.entrypoints.openai.tool_parsers.base import (
    DECODER,
    ParsedCall,
    ToolParser,
    call_from,
    partial_tag_len,
    random_alphanumeric,
    skip_space,
)

TAG = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def make_call_id(self) -> str:
        return random_alphanumeric(9)

    def scan(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        outside: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            at = text.find(TAG, pos)
            if at < 0:
                tail = text[pos:]
                outside.append(tail if final else tail[: len(tail) - partial_tag_len(tail, (TAG,))])
                return "".join(outside), calls
            outside.append(text[pos:at])
            found, end = _calls_after(text, at + len(TAG), final)
            if found is None:
                return "".join(outside), calls  # still being written
            if found:
                calls.extend(found)
            else:
                outside.append(text[at:end])  # kept as written
            pos = end


def _calls_after(text: str, pos: int, final: bool) -> tuple[list[ParsedCall] | None, int]:
    """The calls right after a tag and where they end; [] when the text there is not a call,
    None when it may still become one."""
    unfinished: tuple[list[ParsedCall] | None, int] = (None, pos) if not final else ([], len(text))
    pos = skip_space(text, pos)
    if pos == len(text):
        return unfinished
    if text[pos] == "[":
        try:
            items, end = DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return unfinished
        found = (
            [call_from(item, ("arguments", "parameters")) for item in items]
            if isinstance(items, list)
            else []
        )
        if not found or any(call is None for call in found):
            return [], end
        return found, end  # type: ignore[return-value]
    name = _NAME.match(text, pos)
    if name is None:
        return [], pos
    p = name.end()
    if text.startswith(ARGS, p):
        p += len(ARGS)
    elif not final and ARGS.startswith(text[p:]):
        return unfinished  # the name or the [ARGS] marker may go on
    if p == len(text):
        return unfinished
    if text[p] != "{":
        return [], p
    try:
        args, end = DECODER.raw_decode(text, p)
    except json.JSONDecodeError:
        return unfinished
    if not isinstance(args, dict):
        return [], end
    return [ParsedCall(name.group(), json.dumps(args, ensure_ascii=False))], end
