"""One chat choice's text to what the client gets: the reasoning split off (--reasoning-parser),
then tool calls, parsed from free text (tool_choice "auto") or read from the JSON that a forced
tool_choice constrained; as stream deltas, or as the whole message those deltas add up to.

A call streams as OpenAI's and vLLM's do: its first delta carries the index, id, type, name and
the arguments written so far (maybe none), later ones the index and the next piece of arguments.
A whole reply is the same stream read in one piece, so the two always agree.
"""

from __future__ import annotations

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
    CallDelta,
    ToolCallStream,
    ToolParser,
    make_call_id,
)
from inferengine.entrypoints.openai.tool_parsers.base import skip_space
from inferengine.entrypoints.openai.tool_parsers.json_scan import (
    ArgumentsReader,
    CallReader,
    Read,
)

_START, _CALLS, _CALL, _REST = range(4)


@dataclass(frozen=True)
class ForcedCalls:
    """The reply of a forced tool_choice: a named function's arguments object, or (`name`
    None: "required") an array of {"name", "parameters"}."""

    name: str | None = None

    def stream(self) -> ToolCallStream:
        return NamedCallStream(self.name) if self.name is not None else RequiredCallStream()


class NamedCallStream(ToolCallStream):
    """tool_choice naming a function: the reply is its arguments object, a call from its
    opening brace on. Text that is not one (no grammar applied) is content."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.state = _START

    def step(self, final: bool) -> bool:
        if self.state == _START:
            p = skip_space(self.text, 0)
            if p == len(self.text) and not final:
                return False
            if p < len(self.text) and self.text[p] == "{":
                self.begin_call(ArgumentsReader(p, self.name))
                self.state = _CALL
            else:
                self.state = _REST
            return True
        if self.state == _CALL:
            if self.read(final) is Read.MORE:
                return False
            self.state = _REST
            return True
        self.take(len(self.text))
        return False


class RequiredCallStream(ToolCallStream):
    """tool_choice "required": the reply is a JSON array of {"name", "parameters"}, each item a
    call from the opening brace of its parameters on. A reply without a call is content."""

    def __init__(self) -> None:
        super().__init__()
        self.state = _START
        self.num_calls = 0
        self.item_at = 0

    def step(self, final: bool) -> bool:
        text = self.text
        if self.state == _START:
            p = skip_space(text, 0)
            if p == len(text) and not final:
                return False
            if p < len(text) and text[p] == "[":
                self.pos, self.state = p + 1, _CALLS
            else:
                self.state = _REST
            return True
        if self.state == _CALLS:
            p = skip_space(text, self.pos)
            if self.num_calls and text.startswith(",", p):
                p = skip_space(text, p + 1)
            elif self.num_calls and text.startswith("]", p):
                self.pos, self.state = p + 1, _REST
                return True
            if p == len(text) and not final:
                return False
            if p < len(text) and text[p] == "{":
                self.begin_call(CallReader(p, ("parameters",)))
                self.item_at, self.state = p, _CALL
                return True
            return self._rest(p)
        if self.state == _CALL:
            status = self.read(final)
            if status is Read.MORE:
                return False
            if status is Read.DONE:
                self.num_calls += 1
                self.state = _CALLS
                return True
            return self._rest(self.item_at if status is Read.ERROR else self.pos)
        self.take(len(text))
        return False

    def _rest(self, pos: int) -> bool:
        """The text from `pos` (from the start, without a call) is content."""
        self.pos = pos if self.calls else 0
        self.state = _REST
        return True


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
        """The whole reply, and its finish_reason ("tool_calls" when it ended with calls)."""
        if self.plain:
            return ChatResponseMessage(content=text), finish_reason
        delta, reason = self.stream().feed(text, finish_reason or "stop")
        calls = [
            ToolCall(
                id=d.id or "",
                function=FunctionCall(name=d.function.name or "", arguments=d.function.arguments),
            )
            for d in delta.tool_calls or []
            if d.function is not None and d.function.arguments is not None
        ]
        message = ChatResponseMessage(
            content=delta.content,
            reasoning_content=delta.reasoning_content,
            tool_calls=calls or None,
        )
        return message, reason if finish_reason is not None else None

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


@dataclass
class ReplyStream:
    """One streamed choice; `feed` each text delta and send the `ChatDelta` it returns.
    Reasoning, content and each call's arguments stream as they are written."""

    reader: ReplyReader
    text: str = ""
    sent_reasoning: str = ""
    sent_content: str = ""
    call_ids: list[str] = field(default_factory=list)
    tools: ToolCallStream | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        reader = self.reader
        if reader.forced is not None:
            self.tools = reader.forced.stream()
        elif reader.tool_parser is not None:
            self.tools = reader.tool_parser.stream(reader.max_calls)

    def feed(self, delta: str, finish_reason: str | None) -> tuple[ChatDelta, str | None]:
        """The delta to send and the finish_reason to send with it: "tool_calls" for a reply
        that ended ("stop") with calls; a reply cut short keeps its reason ("length")."""
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
        if self.tools is None:
            out.content = content[len(self.sent_content) :] or None
            self.sent_content = content
        else:
            new_content, calls = self.tools.feed(content[len(self.tools.text) :], final)
            out.content = new_content or None
            out.tool_calls = [self._tool_delta(c) for c in calls] or None
        if final and self.call_ids and finish_reason == "stop":
            finish_reason = "tool_calls"
        return out, finish_reason

    def _tool_delta(self, call: CallDelta) -> DeltaToolCall:
        if call.name is None:
            return DeltaToolCall(
                index=call.index, function=DeltaFunctionCall(arguments=call.arguments)
            )
        self.call_ids.append(self.reader.make_call_id())
        return DeltaToolCall(
            index=call.index,
            id=self.call_ids[-1],
            type="function",
            function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
        )
