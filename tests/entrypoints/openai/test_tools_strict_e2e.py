"""Strict tools with tool_choice "auto" end to end through the official `openai` client, against
a tiny random model whose tokenizer has `<tool_call>` and `</tool_call>` as tokens of their own
(not special, as Qwen's are) and a server with the hermes parser. A logit bias on `<tool_call>`
makes the random model call often: at temperature 1.0, every call it writes to the strict tool
has arguments that fit the tool's parameters; with `response_format` too, every reply that
finishes is either JSON of that schema or only valid calls. Streamed equals whole."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import EOS_ID, build_checkpoint
from tests.entrypoints.openai.server import API_KEY, RemoteServer
from tests.entrypoints.openai.test_tools_e2e import ADD_PARAMS, WEATHER_PARAMS, _streamed, create
from tests.entrypoints.openai.test_tools_strict import CALL_TAG_ID, build_tool_tokenizer

STRICT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER_PARAMS, "strict": True},
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD_PARAMS}},  # not strict
]
ANSWER = {
    "type": "object",
    "properties": {"reply": {"type": "string", "maxLength": 8}},
    "required": ["reply"],
    "additionalProperties": False,
}
ANSWER_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": ANSWER, "strict": True},
}
# The tag often, and the end of text often enough that replies finish within max_tokens (the
# arguments take whitespace as the model likes, and a random model likes a lot).
CALLING = {
    "tools": STRICT_TOOLS,
    "temperature": 1.0,
    "max_tokens": 200,
    "logit_bias": {str(CALL_TAG_ID): 4.0, str(EOS_ID): 2.0},
}
# With an answer to choose too, a smaller bias leaves both replies likely.
EITHER = {**CALLING, "logit_bias": {str(CALL_TAG_ID): 2.0, str(EOS_ID): 2.0}}


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    folder = build_checkpoint("qwen3", tmp_path_factory.mktemp("tool-tags"))
    build_tool_tokenizer().save_pretrained(folder)
    server = RemoteServer(
        folder,
        "--max-model-len",
        "512",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    )
    try:
        server.wait_ready()
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
    finally:
        server.stop()


def check_call(call) -> str:
    """A call to one of the tools whose arguments are a JSON object, those of the strict tool
    fitting its parameters; its name."""
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments, dict), call
    if call.function.name == "get_weather":
        jsonschema.validate(arguments, WEATHER_PARAMS)
    else:
        assert call.function.name == "add", call
    return call.function.name


def test_strict_calls_in_auto_are_held(hermes):
    out = create(hermes, n=24, seed=21, **CALLING)
    strict_calls = finished = 0
    for choice in out.choices:
        calls = choice.message.tool_calls or []
        if choice.finish_reason == "length":
            calls = calls[:-1]  # the last call may have been cut short
        else:
            finished += 1
            assert choice.finish_reason == ("tool_calls" if calls else "stop"), choice
        strict_calls += sum(check_call(call) == "get_weather" for call in calls)
    assert finished >= 5 and strict_calls >= 5, (finished, strict_calls)


def test_response_format_or_strict_calls(hermes):
    out = create(hermes, n=24, seed=22, response_format=ANSWER_FORMAT, **EITHER)
    reasons = [c.finish_reason for c in out.choices]
    for choice in out.choices:
        message = choice.message
        if choice.finish_reason == "stop":  # the answer, in response_format's schema
            assert not message.tool_calls, choice
            jsonschema.validate(json.loads(message.content), ANSWER)
        elif choice.finish_reason == "tool_calls":  # only calls, each valid
            assert message.content is None and message.tool_calls, choice
            for call in message.tool_calls:
                check_call(call)
    assert reasons.count("stop") >= 3 and reasons.count("tool_calls") >= 3, reasons


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seed": 1},  # calls cut short
        {"seed": 10, "parallel_tool_calls": False},  # content and a call
        {"seed": 3, "response_format": ANSWER_FORMAT, **EITHER},  # a call
        {"seed": 8, "response_format": ANSWER_FORMAT, "logit_bias": {}},  # the answer
        {"seed": 5, "response_format": ANSWER_FORMAT, "max_tokens": 10},  # cut before a call
    ],
)
def test_stream_matches_full(hermes, kwargs):
    kwargs = {**CALLING, **kwargs}
    full = create(hermes, **kwargs).choices[0]
    calls = [(t.function.name, t.function.arguments) for t in full.message.tool_calls or []]
    assert _streamed(hermes, **kwargs) == (full.message.content, calls, full.finish_reason)
    if "response_format" in kwargs and full.finish_reason != "length":
        assert (full.message.content is None) == bool(calls)  # the answer or only calls
