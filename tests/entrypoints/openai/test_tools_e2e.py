"""Tool calling end to end through the official `openai` client against the tiny random model:
with tool_choice "required" or a named function the grammar alone makes the reply a valid call,
so every choice that finishes must carry tool calls whose arguments fit the tool's parameters.
Also the 400s a server without tool flags gives, a server started with them, and a reasoning
model's server, whose grammar starts after `</think>`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import build_checkpoint
from tests.entrypoints.openai.server import API_KEY, SERVED_NAME, RemoteServer
from tests.entrypoints.openai.test_tools_api import (
    END_THINK_ID,
    HISTORY,
    TOOL_TEMPLATE,
    build_thinking_tokenizer,
)

# Strings and numbers are bounded so a random model's reply fits in max_tokens.
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD_PARAMS = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
PARAMS = {"get_weather": WEATHER_PARAMS, "add": ADD_PARAMS}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": params}}
    for name, params in PARAMS.items()
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLED = {"temperature": 1.0, "seed": 7, "max_tokens": 100}


def create(client, **kwargs):
    """A chat completion offering TOOLS (tools=None: none)."""
    fields = {"tools": TOOLS, **SAMPLED, **kwargs}
    if fields["tools"] is None:
        del fields["tools"]
    return client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, **fields)


def check_calls(choices, names: set[str], max_calls: int | None = None) -> int:
    """Every finished choice is only valid tool calls; the number finished."""
    finished = 0
    for choice in choices:
        if choice.finish_reason == "length":
            continue
        finished += 1
        message = choice.message
        assert choice.finish_reason == "tool_calls", choice
        assert message.content is None and message.tool_calls, message
        assert max_calls is None or len(message.tool_calls) <= max_calls
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name in names
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    return finished


def test_required_every_time(openai_client):
    out = create(openai_client, n=100, tool_choice="required", parallel_tool_calls=False)
    assert check_calls(out.choices, set(PARAMS), max_calls=1) == 100


def test_named_every_time(openai_client):
    out = create(openai_client, n=100, tool_choice=NAMED)
    assert check_calls(out.choices, {"get_weather"}, max_calls=1) == 100


def test_required_parallel_calls(openai_client):
    out = create(openai_client, n=10, tool_choice="required", max_tokens=300)
    assert check_calls(out.choices, set(PARAMS)) >= 9


def _streamed(client, **kwargs) -> tuple[str | None, list[tuple[str, str]], str | None]:
    content, calls, reason = "", {}, None
    for chunk in create(client, stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for call in c.delta.tool_calls or []:
                slot = calls.setdefault(call.index, ["", ""])
                slot[0] += call.function.name or ""
                slot[1] += call.function.arguments or ""
            reason = c.finish_reason or reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tool_choice": "required", "seed": 1},
        {"tool_choice": "required", "seed": 2, "parallel_tool_calls": False},
        {"tool_choice": NAMED, "seed": 3},
        {"tool_choice": "required", "seed": 4, "max_tokens": 12},  # cut short
        {"tool_choice": NAMED, "seed": 5, "max_tokens": 6},  # cut short in the arguments
    ],
)
def test_stream_matches_full(openai_client, kwargs):
    full = create(openai_client, **kwargs).choices[0]
    calls = [(t.function.name, t.function.arguments) for t in full.message.tool_calls or []]
    assert _streamed(openai_client, **kwargs) == (full.message.content, calls, full.finish_reason)
    if "max_tokens" in kwargs:
        # a call that had begun is kept as written so far; before one began, the text is content
        assert full.finish_reason == "length" and bool(full.message.content) != bool(calls)
    if kwargs["tool_choice"] == NAMED:
        assert calls and calls[0][0] == "get_weather"


def test_arguments_stream_in_pieces(openai_client):
    pieces = []
    for chunk in create(openai_client, stream=True, tool_choice=NAMED, seed=6):
        for c in chunk.choices:
            pieces += [call.model_dump(exclude_none=True) for call in c.delta.tool_calls or []]
    first, rest = pieces[0], pieces[1:]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "get_weather"
    assert len(rest) > 1 and all(set(p) == {"index", "function"} for p in rest)
    arguments = first["function"]["arguments"] + "".join(p["function"]["arguments"] for p in rest)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMS)


# ---- refusals and tool turns on the shared server (no tool flags) --------------------------


@pytest.mark.parametrize(
    ("kwargs", "param", "says"),
    [
        ({}, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
        ({"tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [{"type": "function", "function": {"parameters": {}}}]},
            "tools[0].function.name",
            "required",
        ),
        (
            {"tools": [*TOOLS, TOOLS[0]], "tool_choice": "required"},
            "tools[2].function.name",
            "unique",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
            "not in tools",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
            "both constrain",
        ),
        ({"tools": None, "functions": [TOOLS[0]["function"]]}, "functions", "use tools"),
    ],
)
def test_refused(openai_client, kwargs, param, says):
    with pytest.raises(openai.BadRequestError) as info:
        create(openai_client, **kwargs)
    error = info.value.body
    assert error["param"] == param and says in error["message"], error


def test_tool_turns_render(openai_client, tiny_server):
    tools = TOOLS[:1]  # the prompt stays well inside the tiny context
    body = {"messages": HISTORY, "tools": tools, "chat_template": TOOL_TEMPLATE}
    with tiny_server.client() as client:
        tokens = client.post("/tokenize", json=body).json()["tokens"]
        text = client.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "tool call_1: sunny, 21 degrees" in text and '"arguments": {"city": "Paris"' in text
    out = openai_client.chat.completions.create(
        model=SERVED_NAME,
        messages=HISTORY,
        tools=tools,
        tool_choice=NAMED,
        extra_body={"chat_template": TOOL_TEMPLATE},
        **SAMPLED,
    )
    assert out.usage.prompt_tokens == len(tokens)
    assert check_calls(out.choices, {"get_weather"}) == 1


# ---- a server started with the tool and reasoning flags ------------------------------------


@pytest.fixture(scope="module")
def flagged(tiny_checkpoint):
    server = RemoteServer(
        tiny_checkpoint("qwen3"),
        "--max-model-len",
        "512",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "qwen3",
    )
    try:
        server.wait_ready()
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    finally:
        server.stop()


def test_flagged_server_serves_auto(flagged):
    # A random model writes no <tool_call>: the reply is content, read through both parsers.
    full = create(flagged, tool_choice="auto", max_tokens=16, seed=5).choices[0]
    assert full.finish_reason in ("stop", "length") and not full.message.tool_calls
    assert _streamed(flagged, tool_choice="auto", max_tokens=16, seed=5) == (
        full.message.content,
        [],
        full.finish_reason,
    )


STRICT_TOOLS = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def test_flagged_server_serves_auto_with_strict_tools(flagged):
    # The grammar leaves the reply free until a <tool_call> (which a random model never writes).
    kwargs = {"tools": STRICT_TOOLS, "max_tokens": 16, "seed": 5, "extra_body": NO_THINKING}
    full = create(flagged, **kwargs).choices[0]
    assert full.finish_reason in ("stop", "length") and not full.message.tool_calls
    assert _streamed(flagged, **kwargs) == (full.message.content, [], full.finish_reason)
    # thinking on: the grammar would have to start after a </think> this tokenizer cannot mark
    with pytest.raises(openai.BadRequestError) as info:
        create(flagged, tools=STRICT_TOOLS)
    assert info.value.body["param"] == "tools[0].function.strict"


def test_flagged_server_refuses_structured_output_without_a_think_token(flagged):
    # The test tokenizer spells </think> in several tokens, so the engine cannot tell where the
    # reasoning ends (turning thinking off lifts the refusal: see test_tools_api.py).
    for kwargs, param in (
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": None, "response_format": {"type": "json_object"}}, "response_format"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            create(flagged, **kwargs)
        error = info.value.body
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert "--reasoning-parser qwen3" in error["message"]
        assert "tokenizer has no single </think> token" in error["message"]
        assert "enable_thinking" in error["message"]


# ---- a reasoning model: structured output after </think> -----------------------------------


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    """A server for a tiny model whose tokenizer has <think> and </think> as tokens, with
    --reasoning-parser deepseek_r1: the reply is reasoning until </think>, as the engine sees it."""
    folder = build_checkpoint("qwen3", tmp_path_factory.mktemp("thinking"))
    build_thinking_tokenizer().save_pretrained(folder)
    server = RemoteServer(folder, "--max-model-len", "512", "--reasoning-parser", "deepseek_r1")
    try:
        server.wait_ready()
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    finally:
        server.stop()


# A random model writes </think> now and then; the bias makes it likely within max_tokens.
THINKING = {
    "temperature": 1.0,
    "max_tokens": 300,
    "logit_bias": {str(END_THINK_ID): 3.0},
    "logprobs": True,
}
WEATHER_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "weather", "schema": WEATHER_PARAMS, "strict": True},
}


def _ended_thinking(choice) -> bool:
    return any(t.token == "</think>" for t in choice.logprobs.content)


def test_json_schema_after_reasoning(thinking):
    out = create(thinking, tools=None, n=24, seed=11, response_format=WEATHER_FORMAT, **THINKING)
    answered = 0
    for choice in out.choices:
        message = choice.message
        if not _ended_thinking(choice):
            # all reasoning, however it ended; the grammar never started
            assert message.content is None, choice
            continue
        if choice.finish_reason != "stop":
            continue
        answered += 1
        jsonschema.validate(json.loads(message.content), WEATHER_PARAMS)
    assert answered >= 3, [c.finish_reason for c in out.choices]


def test_json_schema_after_reasoning_streamed(thinking):
    contents: dict[int, str] = {}
    reasons: dict[int, str] = {}
    ended: dict[int, bool] = {}
    stream = create(
        thinking, tools=None, n=12, seed=12, stream=True, response_format=WEATHER_FORMAT, **THINKING
    )
    for chunk in stream:
        for c in chunk.choices:
            contents[c.index] = contents.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
            tokens = c.logprobs.content if c.logprobs is not None else []
            ended[c.index] = ended.get(c.index, False) or any(t.token == "</think>" for t in tokens)
    answered = 0
    for index, content in contents.items():
        if not ended[index]:
            assert not content
        elif reasons[index] == "stop":
            answered += 1
            jsonschema.validate(json.loads(content), WEATHER_PARAMS)
    assert answered >= 2, reasons


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_forced_call_after_reasoning(thinking, tool_choice):
    out = create(thinking, n=24, seed=13, tool_choice=tool_choice, **THINKING)
    names = {"get_weather"} if tool_choice == NAMED else set(PARAMS)
    # every reply that got past </think> and finished is only valid calls
    called = check_calls([c for c in out.choices if _ended_thinking(c)], names)
    assert called >= 3, [c.finish_reason for c in out.choices]
    for choice in out.choices:
        if not _ended_thinking(choice):  # all reasoning: no call
            assert choice.message.content is None and not choice.message.tool_calls, choice
