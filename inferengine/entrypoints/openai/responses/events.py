"""A reply's chat deltas to Responses output items and the stream events that build them.

Each part of the reply becomes an item in the order written: the reasoning (a `reasoning` item
with one `reasoning_text` part), the text (a `message` with one `output_text` part), each tool
call (a `function_call`). An item opens with `response.output_item.added` (and, for a part,
`response.content_part.added`), grows by deltas and closes with the `.done` events, the last one
`response.output_item.done` carrying the whole item. Every event has the stream's next
`sequence_number`. A whole (non-streamed) reply goes through the same builder, so the two agree.
"""

from __future__ import annotations

import uuid
from typing import Any

from inferengine.entrypoints.openai.protocol import ChatDelta, DeltaToolCall

Event = dict[str, Any]
_PART = {"message": "output_text", "reasoning": "reasoning_text"}
_DELTA = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_ID_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


def item_id(kind: str) -> str:
    return f"{_ID_PREFIX[kind]}_{uuid.uuid4().hex}"


class OutputBuilder:
    """`feed` chat deltas, then `close`; `take` the events written so far; `items` is the
    output. `sequence_number` counts every event of the stream, so the response's own events
    (`response.created`, ...) are made here too (`event`)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.sequence_number = 0
        self._events: list[Event] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._calls: dict[int, dict[str, Any]] = {}  # chat's call index -> its item
        self._indexes: dict[str, int] = {}  # item id -> output_index

    def event(self, kind: str, **fields: Any) -> Event:
        """The next event (not queued)."""
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def feed(self, delta: ChatDelta) -> None:
        if delta.reasoning_content:
            self._write("reasoning", delta.reasoning_content)
        if delta.content:
            self._write("message", delta.content)
        for call in delta.tool_calls or []:
            self._call(call)

    def close(self, status: str = "completed") -> None:
        """End the item being written with `status` ("incomplete": the reply was cut short).
        A reply with no output at all gets an empty message, as OpenAI's API sends."""
        if not self.items:
            self._begin("message")
        self._end(status)

    # ---- items -----------------------------------------------------------------------------

    def _queue(self, kind: str, **fields: Any) -> None:
        self._events.append(self.event(kind, **fields))

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self._indexes[item["id"]]}

    def _begin(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._end("completed")
        item: dict[str, Any] = {"id": item_id(kind), "type": kind}
        if kind == "message":
            item.update(status="in_progress", role="assistant", content=[])
        elif kind == "reasoning":
            item.update(summary=[], content=[], status="in_progress")
        else:
            item.update(fields, status="in_progress")
        self._indexes[item["id"]] = len(self.items)
        self.items.append(item)
        self._open = item
        self._queue(
            "response.output_item.added", output_index=len(self.items) - 1, item=_copy(item)
        )
        if kind in _PART:
            part = _part(kind, "")
            item["content"].append(part)
            self._queue(
                "response.content_part.added",
                **self._where(item),
                content_index=0,
                part=_copy(part),
            )
        return item

    def _write(self, kind: str, text: str) -> None:
        item = self._open
        if item is None or item["type"] != kind:
            item = self._begin(kind)
        item["content"][0]["text"] += text
        self._queue(f"{_DELTA[kind]}.delta", **self._where(item), content_index=0, delta=text)
        if kind == "message":
            self._events[-1]["logprobs"] = []

    def _call(self, call: DeltaToolCall) -> None:
        arguments = call.function.arguments if call.function is not None else None
        if call.id is not None:  # a call's first delta: its id and name
            name = call.function.name if call.function is not None else None
            item = self._begin("function_call", call_id=call.id, name=name or "", arguments="")
            self._calls[call.index] = item
        else:
            item = self._calls[call.index]
        if arguments:
            item["arguments"] += arguments
            self._queue(
                "response.function_call_arguments.delta", **self._where(item), delta=arguments
            )

    def _end(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        where = self._where(item)
        if item["type"] == "function_call":
            self._queue(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            )
        else:
            part = item["content"][0]
            done = {"text": part["text"]}
            if item["type"] == "message":
                done["logprobs"] = []
            self._queue(f"{_DELTA[item['type']]}.done", **where, content_index=0, **done)
            self._queue("response.content_part.done", **where, content_index=0, part=_copy(part))
        item["status"] = status
        self._queue(
            "response.output_item.done", output_index=where["output_index"], item=_copy(item)
        )


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item or part as it is now (the builder keeps writing the original)."""
    return {
        k: [_copy(x) if isinstance(x, dict) else x for x in v] if isinstance(v, list) else v
        for k, v in value.items()
    }
