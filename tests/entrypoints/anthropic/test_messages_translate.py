"""The Messages request as chat's request, the reply's blocks and the error shapes, without an
engine: which chat message each block becomes, where a cache_control mark lands, the tool_choice
and thinking mappings, block events for reasoning, text and calls, stop reasons, usage."""

from __future__ import annotations

import json

import pytest

from inferengine.entrypoints.anthropic.errors import _reshaped_events, stream_error_event
from inferengine.entrypoints.anthropic.protocol import CountTokensRequest, MessagesRequest
from inferengine.entrypoints.anthropic.reply import BlockStream, stop_reason, usage
from inferengine.entrypoints.anthropic.translate import translate
from inferengine.entrypoints.openai.chat_reply import ForcedCalls, ReplyReader
from inferengine.entrypoints.openai.protocol import ChatDelta, DeltaFunctionCall, DeltaToolCall
from inferengine.entrypoints.openai.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from inferengine.errors import InvalidRequestError, OverloadedError

EPH = {"type": "ephemeral"}


def chat(parser=None, **fields):
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
    return translate(MessagesRequest(**(body | fields)), parser).chat


def test_blocks_become_chat_messages_in_order():
    req = chat(
        system=[{"type": "text", "text": "Be brief.", "cache_control": EPH}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sun", "cache_control": EPH},
                    {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "no"}], "is_error": True},
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
    )  # fmt: skip
    got = [m.model_dump(exclude_none=True) for m in req.messages]
    assert got == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief.", "cache_control": EPH}]},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}],
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}],
            "reasoning_content": "Use the tool.",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "sun", "cache_control": EPH},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no"},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]  # fmt: skip
    assert req.add_generation_prompt and not req.continue_final_message


def test_marks_on_tools_and_on_the_request_and_a_prefill():
    tool = {"name": "w", "input_schema": {"type": "object"}, "cache_control": {**EPH, "ttl": "1h"}}
    req = chat(
        tools=[tool],
        cache_control=EPH,
        messages=[
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "The answer is"},
        ],
    )
    first, last = (m.model_dump(exclude_none=True) for m in req.messages)
    assert first["cache_control"] == tool["cache_control"] and last["cache_control"] == EPH
    assert req.tools == [
        {"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}
    ]
    assert req.continue_final_message and not req.add_generation_prompt  # Anthropic's prefill


@pytest.mark.parametrize(
    ("choice", "tool_choice", "parallel"),
    [
        (None, None, None),
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "tool", "name": "w"}, {"type": "function", "function": {"name": "w"}}, None),
        ({"type": "none"}, "none", None),
    ],
)
def test_tool_choice(choice, tool_choice, parallel):
    req = chat(tools=[{"name": "w", "input_schema": {}}], tool_choice=choice)
    assert (req.tool_choice, req.parallel_tool_calls) == (tool_choice, parallel)


def test_thinking_and_output_format():
    qwen3 = Qwen3ReasoningParser()
    on = chat(qwen3, thinking={"type": "enabled", "budget_tokens": 10})
    off = chat(qwen3, thinking={"type": "disabled"})
    assert on.chat_template_kwargs == {"enable_thinking": True}
    assert off.chat_template_kwargs == {"enable_thinking": False}
    assert (
        chat(DeepSeekR1ReasoningParser(), thinking={"type": "adaptive"}).chat_template_kwargs
        is None
    )
    with pytest.raises(InvalidRequestError, match="--reasoning-parser"):
        chat(None, thinking={"type": "enabled", "budget_tokens": 10})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "schema": schema}}
    assert chat(output_config=fmt).structured_outputs == {"json": schema}
    with pytest.raises(InvalidRequestError, match=r"output_config\.format and a tool_choice"):
        chat(
            output_config=fmt,
            tools=[{"name": "w", "input_schema": {}}],
            tool_choice={"type": "any"},
        )


def test_count_tokens_request_has_no_generation_fields():
    req = CountTokensRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    translated = translate(req, None).chat
    assert translated.max_tokens is None and translated.stop is None and not translated.stream


def reader_events(reader: ReplyReader, pieces: list[str]) -> tuple[list[dict], list[dict]]:
    stream, blocks = reader.stream(), BlockStream()
    events = []
    for i, piece in enumerate(pieces):
        delta, _ = stream.feed(piece, "stop" if i == len(pieces) - 1 else None)
        events += blocks.feed(delta)
    return events + blocks.close(), blocks.blocks


def test_reasoning_then_text_as_two_blocks():
    reader = ReplyReader(reasoning=Qwen3ReasoningParser())
    events, blocks = reader_events(reader, ["<think>", "Hmm, ", "ok</think>", "\n\nHello", " you"])
    assert [(e["type"], e.get("index"), (e.get("delta") or {}).get("type")) for e in events] == [
        ("content_block_start", 0, None),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, None),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
    ]
    assert blocks == [
        {"type": "thinking", "thinking": "Hmm, ok", "signature": ""},
        {"type": "text", "text": "Hello you"},
    ]


def test_a_forced_call_as_a_tool_use_block():
    reader = ReplyReader(forced=ForcedCalls("w"), make_call_id=lambda: "toolu_1")
    events, blocks = reader_events(reader, ['{"ci', 'ty": "Oslo"', "}"])
    assert events[0] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {}},
    }
    partial = "".join(
        e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
    )
    assert json.loads(partial) == {"city": "Oslo"}
    assert blocks == [{"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Oslo"}}]


def test_a_second_call_closes_the_first():
    blocks = BlockStream()
    first = DeltaToolCall(index=0, id="a", function=DeltaFunctionCall(name="x", arguments="{}"))
    second = DeltaToolCall(index=1, id="b", function=DeltaFunctionCall(name="y", arguments="{"))
    events = blocks.feed(ChatDelta(content="Calling.", tool_calls=[first, second]))
    events += blocks.close()
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
    ]  # fmt: skip
    assert blocks.blocks[2]["input"] == {}  # cut off: {} rather than a half object


def test_stop_reasons_and_usage():
    assert stop_reason("tool_calls", None) == ("tool_use", None)
    assert stop_reason("length", None) == ("max_tokens", None)
    assert stop_reason("stop", "END") == ("stop_sequence", "END")
    assert stop_reason("stop", 1) == ("end_turn", None)  # the EOS token
    assert usage(100, 5, 32, ((48, 300.0), (90, 300.0))) == {
        "input_tokens": 10,
        "output_tokens": 5,
        "cache_creation_input_tokens": 58,
        "cache_read_input_tokens": 32,
        "service_tier": "standard",
    }
    assert usage(100, 5, 96, ((90, 300.0),))["cache_creation_input_tokens"] == 0


def test_error_events():
    event = stream_error_event(OverloadedError("queue full"))
    assert event.startswith("event: error\ndata: ")
    assert json.loads(event.split("data: ", 1)[1]) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "queue full"},
    }
    cut = b'data: {"error": {"message": "shutting down", "type": "x", "param": null, "code": 503}}\n\ndata: [DONE]\n\n'
    assert _reshaped_events(cut).decode() == (
        'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
        '"message": "shutting down"}}\n\n'
    )
