"""The chat reply reader's deltas as Anthropic content blocks: stream events, or the whole message.

`chat_reply.ReplyStream` splits a reply into reasoning, text and tool calls (the same reading chat
does); `BlockStream` turns its deltas into Anthropic's blocks, in order: a `thinking` block, `text`
blocks and `tool_use` blocks, each opened by `content_block_start`, grown by `content_block_delta`
(`thinking_delta`, `text_delta`, `input_json_delta`) and closed by `content_block_stop` before
the next opens. A whole reply is the same stream fed in one piece, so the two always agree.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from inferengine.entrypoints.openai.protocol import ChatDelta

Event = dict[str, Any]


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


@dataclass
class BlockStream:
    """Anthropic content blocks from chat deltas; `blocks` holds what was sent so far."""

    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks stay empty
    blocks: list[dict[str, Any]] = field(default_factory=list)
    _open: tuple[str, int | None] | None = None  # (block type, tool call index)
    _arguments: dict[int, str] = field(default_factory=dict)  # by block index

    def feed(self, delta: ChatDelta) -> list[Event]:
        """The events for one chat delta (reasoning, then text, then tool calls)."""
        events: list[Event] = []
        if delta.reasoning_content:
            events += self._grow(("thinking", None), delta.reasoning_content)
        if delta.content:
            events += self._grow(("text", None), delta.content)
        for call in delta.tool_calls or []:
            key = ("tool_use", call.index)
            function = call.function
            if call.id is not None and function is not None:  # a call's first delta
                events += self._start(
                    key, {"type": "tool_use", "id": call.id, "name": function.name, "input": {}}
                )
            if function is not None and function.arguments:
                events += self._grow(key, function.arguments)
        return events

    def close(self) -> list[Event]:
        """The last block's `content_block_stop`, if one is open."""
        if self._open is None:
            return []
        self._open = None
        index = len(self.blocks) - 1
        block = self.blocks[index]
        if block["type"] == "tool_use":
            block["input"] = _arguments_object(self._arguments.get(index, ""))
        return [{"type": "content_block_stop", "index": index}]

    def _start(self, key: tuple[str, int | None], block: dict[str, Any]) -> list[Event]:
        events = self.close()
        self._open = key
        self.blocks.append(block)
        start = dict(block)
        return [*events, {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}]  # fmt: skip

    def _grow(self, key: tuple[str, int | None], piece: str) -> list[Event]:
        kind = key[0]
        events: list[Event] = []
        if self._open != key:
            empty = {"thinking": {"thinking": "", "signature": ""}, "text": {"text": ""}}[kind]
            events += self._start(key, {"type": kind, **empty})
        index = len(self.blocks) - 1
        block = self.blocks[index]
        if kind == "thinking":
            if self.omit_thinking:
                return events
            block["thinking"] += piece
            delta = {"type": "thinking_delta", "thinking": piece}
        elif kind == "text":
            block["text"] += piece
            delta = {"type": "text_delta", "text": piece}
        else:
            self._arguments[index] = self._arguments.get(index, "") + piece
            delta = {"type": "input_json_delta", "partial_json": piece}
        return [*events, {"type": "content_block_delta", "index": index, "delta": delta}]


def _arguments_object(text: str) -> dict[str, Any]:
    """A call's arguments as an object; {} when they were cut off (max_tokens) or empty."""
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str | None, engine_stop: int | str | None) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for the chat reader's finish reason
    ("tool_calls" for a reply that ended with calls) and the engine's stop reason (the stop
    string that ended the reply, when one did)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str):
        return "stop_sequence", engine_stop
    return "end_turn", None


def usage(
    num_prompt: int,
    output_tokens: int,
    cached: int,
    breakpoints: tuple[tuple[int, float], ...] = (),
) -> dict[str, Any]:
    """Anthropic's usage: the prompt split into tokens read from the cache, tokens written to it
    at a cache_control breakpoint (up to the last one), and the rest (`input_tokens`); the three
    add up to the prompt."""
    written = max(0, max((n for n, _ in breakpoints), default=0) - cached)
    return {
        "input_tokens": num_prompt - cached - written,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "service_tier": "standard",
    }


def message(
    msg_id: str,
    model: str,
    blocks: list[dict[str, Any]],
    reason: str | None,
    sequence: str | None,
    use: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": use,
    }


# Characters some clients' line readers split lines at, escaped so an event stays on its line.
_LINE_BREAKS = str.maketrans({c: f"\\u{ord(c):04x}" for c in "\x1c\x1d\x1e\x85\u2028\u2029"})


def sse_event(event: Event) -> str:
    """One Anthropic server-sent event: its type as the event name, then its JSON."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    return f"event: {event['type']}\ndata: {data}\n\n"
