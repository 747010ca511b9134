"""One chat choice's text to what the client gets: the reasoning split off (--reasoning-parser),
then tool calls, parsed from free text (tool_choice "auto") or read from the JSON that a forced
tool_choice constrained; as a whole message, or as stream deltas that add up to it."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from inferengine.entrypoints.openai.protocol import (
    ChatDelta,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from inferengine.entrypoints.openai.reasoning_parsers import ReasoningParser
from inferengine.entrypoints.openai.tool_parsers import (
    ParsedCall,
    ToolCallStream,
    ToolParser,
    make_call_id,
)


@dataclass(frozen=True)
class ForcedCalls:
    """The reply of a forced tool_choice: a named function's arguments object, or (`name`
    None: "required") an array of {"name", "parameters"}."""

    name: str | None = None

    def calls(self, text: str) -> list[ParsedCall] | None:
        """The calls; None if the text is not the JSON asked for (cut short, say)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is not None:
            return [ParsedCall(self.name, text)] if isinstance(value, dict) else None
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:
            if not (
                isinstance(item, dict)
                and isinstance(item.get("name"), str)
                and isinstance(item.get("parameters"), dict)
            ):
                return None
            calls.append(
                ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            )
        return calls


@dataclass(frozen=True)
class ReplyReader:
    """How a request's choices are read; the default reads the text as plain content."""

    num_top: int | None = None  # top logprobs per token; None: no logprobs
    reasoning: ReasoningParser | None = None
    tool_parser: ToolParser | None = None  # tool_choice "auto"
    forced: ForcedCalls | None = None  # tool_choice "required" or named
    max_calls: int | None = None  # 1 when parallel_tool_calls is false ("auto")
    # The stop token's text ends the reply when special tokens are decoded for the parser.
    strip_stop_token: bool = False
    make_call_id: Callable[[], str] = make_call_id

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tool_parser is None and self.forced is None

    def message(
        self, text: str, finish_reason: str | None
    ) -> tuple[ChatResponseMessage, str | None]:
        """The whole reply, and its finish_reason ("tool_calls" when there are calls)."""
        if self.plain:
            return ChatResponseMessage(content=text), finish_reason
        reasoning, content = (
            (None, text) if self.reasoning is None else self.reasoning.extract(text)
        )
        calls: list[ParsedCall] = []
        if self.forced is not None:
            if finish_reason == "stop":
                calls = self.forced.calls(content or "") or []
            if calls:
                content = None
        elif self.tool_parser is not None:
            content, calls = self.tool_parser.extract(content or "")
            calls = calls[: self.max_calls]
        message = ChatResponseMessage(
            content=content,
            reasoning_content=reasoning,
            tool_calls=[
                ToolCall(
                    id=self.make_call_id(),
                    function=FunctionCall(name=c.name, arguments=c.arguments),
                )
                for c in calls
            ]
            or None,
        )
        return message, "tool_calls" if calls else finish_reason

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


@dataclass
class ReplyStream:
    """One streamed choice; `feed` each text delta and send the `ChatDelta` it returns. Reasoning
    and content stream as they come; with tool_choice "auto" each call is sent whole once its text
    closes; with a forced tool_choice the calls (or, cut short, the text) come with the last
    delta."""

    reader: ReplyReader
    text: str = ""
    sent_reasoning: str = ""
    sent_content: str = ""
    called: bool = False
    tools: ToolCallStream | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.reader.tool_parser is not None:
            self.tools = self.reader.tool_parser.stream(self.reader.max_calls)

    def feed(self, delta: str, finish_reason: str | None) -> tuple[ChatDelta, str | None]:
        """The delta to send and the finish_reason to send with it."""
        reader = self.reader
        if reader.plain:
            return ChatDelta(content=delta or None), finish_reason
        final = finish_reason is not None
        self.text += delta
        if reader.reasoning is None:
            reasoning, content = "", self.text
        else:
            reasoning, content = reader.reasoning.split(self.text, final)
        out = ChatDelta(reasoning_content=reasoning[len(self.sent_reasoning) :] or None)
        self.sent_reasoning = reasoning
        calls: list[ParsedCall] = []
        if reader.forced is not None:
            if final:
                calls = (reader.forced.calls(content) if finish_reason == "stop" else None) or []
                out.content = None if calls else (content or None)
        elif self.tools is not None:
            new_content, calls = self.tools.feed(content[len(self.tools.text) :], final)
            out.content = new_content or None
        else:
            out.content = content[len(self.sent_content) :] or None
            self.sent_content = content
        if calls:
            start = self.tools.num_sent_calls - len(calls) if self.tools is not None else 0
            out.tool_calls = [
                DeltaToolCall(
                    index=start + i,
                    id=reader.make_call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=c.name, arguments=c.arguments),
                )
                for i, c in enumerate(calls)
            ]
            self.called = True
        if final and self.called:
            finish_reason = "tool_calls"
        return out, finish_reason
