"""The Responses API's parts without an engine: the store's bounds and expiry, the output
builder's exact event sequence (reasoning, text and calls in one reply), and the translation of
input items, tools, tool_choice, text.format and reasoning to the chat request."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from inferengine.entrypoints.openai.chat_reply import ReplyReader
from inferengine.entrypoints.openai.protocol import ChatDelta, DeltaFunctionCall, DeltaToolCall
from inferengine.entrypoints.openai.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from inferengine.entrypoints.openai.responses.events import OutputBuilder
from inferengine.entrypoints.openai.responses.protocol import ResponsesRequest
from inferengine.entrypoints.openai.responses.serving import ResponseRun
from inferengine.entrypoints.openai.responses.store import ResponseStore, _size
from inferengine.entrypoints.openai.responses.translate import (
    chat_messages,
    chat_request,
    chat_tool_choice,
    chat_tools,
    rename,
    response_format,
    thinking_kwargs,
)
from inferengine.errors import InvalidRequestError
from inferengine.sampling_params import SamplingParams

# ---- the store ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def response(response_id: str, text: str = "hi") -> dict[str, Any]:
    return {"id": response_id, "output": [{"type": "message", "content": text}]}


def test_store_keeps_at_most_max_responses_oldest_out_first():
    store = ResponseStore(max_responses=2, max_bytes=1 << 20, ttl_s=60)
    for name in ("a", "b", "c"):
        assert store.put(response(name), [], "s")
    assert store.get("a") is None and len(store) == 2
    assert store.get("b").response["id"] == "b" and store.get("c") is not None


def test_store_keeps_at_most_max_bytes():
    one = _size(response("a", "x" * 100)) + _size([])
    store = ResponseStore(max_responses=100, max_bytes=2 * one + 10, ttl_s=60)
    for name in ("a", "b", "c"):
        store.put(response(name, "x" * 100), [], "s")
    assert [n for n in "abc" if store.get(n)] == ["b", "c"]
    assert store.num_bytes == 2 * one
    # alone larger than the bound: not kept, and nothing else dropped for it
    assert not store.put(response("big", "x" * 1000), [], "s")
    assert store.get("big") is None and len(store) == 2


def test_store_forgets_a_response_after_its_ttl():
    clock = Clock()
    store = ResponseStore(max_responses=10, max_bytes=1 << 20, ttl_s=60, clock=clock)
    store.put(response("a"), [], "s")
    clock.now += 30
    store.put(response("b"), [], "s")
    clock.now += 31  # a is 61 s old, b 31 s
    assert store.get("a") is None and store.get("b") is not None
    assert store.num_bytes == _size(response("b")) + _size([])
    clock.now += 30
    assert store.get("b") is None and len(store) == 0 and store.num_bytes == 0


def test_store_delete_and_conversation():
    store = ResponseStore(max_responses=10, max_bytes=1 << 20, ttl_s=60)
    history = [{"type": "message", "role": "user", "content": "q"}]
    store.put(response("a", "answer"), history, "session-1")
    stored = store.get("a")
    assert stored.session == "session-1"
    assert stored.conversation == [*history, {"type": "message", "content": "answer"}]
    assert store.delete("a") and not store.delete("a") and store.num_bytes == 0


# ---- the output builder ------------------------------------------------------------------


def call_delta(index: int, name: str | None, arguments: str, call_id: str | None = None):
    fn = DeltaFunctionCall(name=name, arguments=arguments)
    return ChatDelta(tool_calls=[DeltaToolCall(index=index, id=call_id, function=fn)])


def test_builder_events_for_reasoning_text_and_two_calls():
    out = OutputBuilder()
    out.event("response.created")
    out.feed(ChatDelta(reasoning_content="Let me"))
    out.feed(ChatDelta(reasoning_content=" think."))
    out.feed(ChatDelta(content="Checking."))
    out.feed(call_delta(0, "get_weather", '{"city": ', "call_1"))
    out.feed(call_delta(0, None, '"Paris"}'))
    out.feed(call_delta(1, "add", "", "call_2"))
    out.feed(call_delta(1, None, "{}"))
    out.close()
    events = out.take()
    assert [e["sequence_number"] for e in events] == list(range(1, len(events) + 1))
    assert [(e["type"], e.get("output_index")) for e in events] == [
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.output_item.added", 3),
        ("response.function_call_arguments.delta", 3),
        ("response.function_call_arguments.done", 3),
        ("response.output_item.done", 3),
    ]
    reasoning, message, call, add = out.items
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert reasoning["summary"] == [] and reasoning["id"].startswith("rs_")
    assert message["content"][0]["text"] == "Checking." and message["role"] == "assistant"
    assert call == {
        "id": call["id"],
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    }
    assert add["arguments"] == "{}" and add["call_id"] == "call_2"
    assert events[0]["item"]["status"] == "in_progress"  # the item as it was when added
    assert events[0]["item"]["content"] == [] and events[13]["item"]["arguments"] == ""
    assert events[16] | {"sequence_number": 0} == {
        "type": "response.function_call_arguments.done",
        "sequence_number": 0,
        "item_id": call["id"],
        "output_index": 2,
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert {e.get("item_id") or e["item"]["id"] for e in events[:7]} == {reasoning["id"]}


def test_builder_cut_short_and_empty_replies():
    out = OutputBuilder()
    out.feed(ChatDelta(content="Hello"))
    out.close("incomplete")
    (message,) = out.items
    assert message["status"] == "incomplete"
    assert out.take()[-1]["item"]["status"] == "incomplete"
    empty = OutputBuilder()
    empty.close()  # a reply with no text: one empty message, as OpenAI's API sends
    assert [e["type"] for e in empty.take()] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert empty.items[0]["content"][0]["text"] == ""


# ---- translation -------------------------------------------------------------------------


def test_items_to_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": "{}", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]  # fmt: skip
    assert chat_messages("Instructions.", items) == [
        {"role": "system", "content": "Instructions."},
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "hmm",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "g", "arguments": '{"x": 1}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
    ]


def test_tools_tool_choice_and_text_format_to_chat():
    tools = [
        {"type": "function", "name": "f", "parameters": {"type": "object"}},
        {"type": "function", "name": "g", "description": "G.", "strict": False},
    ]
    assert chat_tools(tools) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}},
        {"type": "function", "function": {"name": "g", "description": "G.", "strict": False}},
    ]  # fmt: skip
    with pytest.raises(InvalidRequestError) as e:
        chat_tools([{"type": "function", "name": "f", "function": {}}])
    assert e.value.param == "tools[0].function" and e.value.code == "unknown_parameter"
    assert chat_tool_choice({"type": "function", "name": "f"}) == {
        "type": "function",
        "function": {"name": "f"},
    }
    assert chat_tool_choice("required") == "required"
    schema = {"type": "object"}
    spec = {"type": "json_schema", "name": "a", "schema": schema, "strict": True}
    assert response_format({"format": spec}) == {
        "type": "json_schema",
        "json_schema": {"name": "a", "schema": schema, "strict": True},
    }
    assert response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    assert response_format({"verbosity": "medium"}) is None


def test_chat_params_renamed_to_responses_fields():
    assert rename("response_format.json_schema.schema") == "text.format.schema"
    assert rename("tools[3].function.parameters") == "tools[3].parameters"
    assert rename("tools[0].function") == "tools[0]"
    assert rename("tool_choice.function.name") == "tool_choice.name"
    assert rename("messages[2].tool_calls[0].function.arguments") == "input"
    assert rename("max_tokens must be at least 1") == "max_output_tokens must be at least 1"


def test_reasoning_effort_and_summary():
    def request(**reasoning: Any) -> ResponsesRequest:
        return ResponsesRequest(input="hi", reasoning=reasoning)

    qwen3, r1 = Qwen3ReasoningParser(), DeepSeekR1ReasoningParser()
    assert thinking_kwargs(request(effort="medium", summary="auto"), r1) == {}
    assert thinking_kwargs(request(effort="none"), qwen3) == {"enable_thinking": False}
    for effort, parser in (("none", r1), ("none", None), ("high", qwen3), ("low", None)):
        with pytest.raises(InvalidRequestError) as e:
            thinking_kwargs(request(effort=effort), parser)
        assert e.value.param == "reasoning.effort"
    with pytest.raises(InvalidRequestError) as e:
        thinking_kwargs(request(summary="concise"), qwen3)
    assert e.value.param == "reasoning.summary"
    chat = chat_request(
        request(effort="none"), [{"role": "user", "content": "hi"}], qwen3, "s", "5m"
    )
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert (chat.prompt_cache_key, chat.prompt_cache_retention) == ("s", "5m")


# ---- a stream that fails -----------------------------------------------------------------


def test_a_failed_stream_ends_with_error_then_response_failed():
    chat = SimpleNamespace(model_name="tiny")
    serving = SimpleNamespace(chat=chat, store=None)
    req = ResponsesRequest(input="hi", max_output_tokens=4)
    run = ResponseRun(serving, req, "resp_1", SamplingParams(max_tokens=4), ReplyReader(), 3)
    run.builder.event("response.created")
    run.builder.feed(ChatDelta(content="Hel"))
    run.builder.take()
    for error, code, message in (
        (InvalidRequestError("bad grammar", param="text"), "invalid_request_error", "bad grammar"),
        (RuntimeError("boom"), "server_error", "internal error: RuntimeError: boom"),
    ):
        error_event, failed = run.failed(error)
        assert error_event["type"] == "error" and failed["type"] == "response.failed"
        assert (error_event["code"], error_event["message"]) == (code, message)
        assert failed["sequence_number"] == error_event["sequence_number"] + 1
        response = failed["response"]
        assert response["status"] == "failed" and response["id"] == "resp_1"
        assert response["error"] == {"code": code, "message": message}
        assert [item["type"] for item in response["output"]] == ["message"]  # what was written
