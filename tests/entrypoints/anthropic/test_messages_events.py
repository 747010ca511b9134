"""The Messages stream on the wire, event by event, against Anthropic's documented sequence
(https://docs.anthropic.com/en/docs/build-with-claude/streaming): `message_start` (an empty
assistant message, stop_reason null, the usage so far), `ping`, then per content block
`content_block_start` / `content_block_delta`* / `content_block_stop`, then `message_delta`
(stop_reason, stop_sequence, usage) and `message_stop`; every event named by its type."""

from __future__ import annotations

import json
import re

from tests.entrypoints.openai.server import SERVED_NAME

TOOLS = [
    {
        "name": "get_weather",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]


def events(http, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a streamed request."""
    with http.stream("POST", "/v1/messages", json=body | {"stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    out = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        payload = json.loads(data[len("data: ") :])
        assert payload["type"] == name[len("event: ") :]  # the name is the type
        out.append((name[len("event: ") :], payload))
    return out


def squeeze(names: list[str]) -> str:
    """The names with runs of deltas written once, as `content_block_delta+`."""
    return re.sub(
        r"(content_block_delta )+", "content_block_delta+ ", " ".join(names) + " "
    ).strip()


def test_a_text_reply_streams_in_the_documented_order(http):
    body = {"model": SERVED_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    got = events(http, body | {"temperature": 0.0})
    assert squeeze([name for name, _ in got]) == (
        "message_start ping content_block_start content_block_delta+ content_block_stop "
        "message_delta message_stop"
    )
    start = got[0][1]["message"]
    assert start["id"].startswith("msg_") and start["type"] == "message"
    assert (start["role"], start["model"], start["content"]) == ("assistant", SERVED_NAME, [])
    assert start["stop_reason"] is None and start["stop_sequence"] is None
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] > 0
    assert got[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [data for name, data in got if name == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert got[-3][1] == {"type": "content_block_stop", "index": 0}
    end = got[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 8
    assert got[-1][1] == {"type": "message_stop"}
    # the same reply whole
    whole = http.post("/v1/messages", json=body | {"temperature": 0.0}).json()
    assert whole["content"] == [
        {"type": "text", "text": "".join(d["delta"]["text"] for d in deltas)}
    ]
    assert whole["usage"]["output_tokens"] == 8 and whole["stop_reason"] == "max_tokens"


def test_a_tool_call_streams_its_input_as_json_deltas(http):
    body = {
        "model": SERVED_NAME,
        "max_tokens": 60,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "thinking": {"type": "disabled"},
        "temperature": 0.0,
    }
    got = events(http, body)
    assert squeeze([name for name, _ in got]) == (
        "message_start ping content_block_start content_block_delta+ content_block_stop "
        "message_delta message_stop"
    )
    block = got[2][1]["content_block"]
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", {})
    assert block["id"]
    deltas = [data["delta"] for name, data in got if name == "content_block_delta"]
    assert {d["type"] for d in deltas} == {"input_json_delta"}
    streamed = json.loads("".join(d["partial_json"] for d in deltas))
    assert isinstance(streamed["city"], str)
    assert got[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    whole = http.post("/v1/messages", json=body).json()
    (call,) = whole["content"]
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "get_weather", streamed)
    assert whole["stop_reason"] == "tool_use"


def test_count_tokens_answers_the_prompt_length(http):
    body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS}
    counted = http.post("/v1/messages/count_tokens", json=body)
    assert counted.status_code == 200 and counted.json().keys() == {"input_tokens"}
    no_tools = http.post("/v1/messages/count_tokens", json=body | {"tools": None}).json()
    assert counted.json()["input_tokens"] > no_tools["input_tokens"] > 0  # tools are prompt
