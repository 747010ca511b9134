"""`/v1/responses` end to end through the official `openai` client, unchanged, against an
in-process app (one engine for the module): a tiny random model whose tokenizer carries Qwen2.5's
chat template (tool turns as `<tool_call>` / `<tool_response>`) and a server with the hermes
parser. Whole and streamed replies (the exact event sequence), a full tool loop both by
`previous_response_id` and statelessly, strict JSON output, a multi-turn conversation whose
later turn reuses the earlier turns' KV (cached input tokens), the store's GET and DELETE, and
bad input as OpenAI-shaped errors naming the field.

The random model never calls a tool by itself, so a call is forced with a named tool_choice
(the grammar makes the reply the call); the turn after it leaves tool_choice "auto"."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from inferengine.core.engine_io import EngineCoreRequest
from inferengine.engine.arg_utils import EngineArgs
from inferengine.entrypoints.openai.api_server import build_app
from inferengine.entrypoints.openai.config import ServerConfig
from tests.conftest import build_tokenizer
from tests.entrypoints.openai.server import SERVED_NAME
from tests.entrypoints.openai.test_errors import assert_error
from tests.entrypoints.test_chat_messages import load_template

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "parameters": CITY}
NAMED = {"type": "function", "name": "get_weather"}
QUESTION = "What is the weather in Paris today? Please answer briefly."
INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence."


class App:
    """The in-process app: the SDK's client on it, raw HTTP, and the engine requests it sent."""

    def __init__(self, http: Any, tokenizer: Any):
        self.http = http
        self.tokenizer = tokenizer
        self.client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )
        self.sent: list[EngineCoreRequest] = []

    def prompt_text(self, request: EngineCoreRequest) -> str:
        return self.tokenizer.decode(request.prompt_token_ids)


@contextmanager
def open_app(tiny_checkpoint: Any, folder: Path, **config: Any) -> Iterator[App]:
    """The in-process app over the tiny model with Qwen2.5's template, served with `config`."""
    from starlette.testclient import TestClient

    for path in tiny_checkpoint("qwen3").iterdir():
        if path.suffix in (".json", ".safetensors") and not path.name.startswith("tokenizer"):
            shutil.copy(path, folder)
    tokenizer = build_tokenizer(("<|im_start|>", "<|im_end|>"))
    tokenizer.chat_template = load_template("qwen2_5")
    tokenizer.save_pretrained(folder)
    args = EngineArgs(
        model=str(folder),
        max_model_len=1024,
        kv_cache_memory=16 << 20,
        served_model_name=SERVED_NAME,
    )
    server_config = ServerConfig(disable_web_ui=True, **config)
    with TestClient(build_app(args.create_engine_config(), server_config)) as http:
        deadline = time.monotonic() + 180
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the in-process engine did not start"
            time.sleep(0.1)
        state = http.app.state.server
        app = App(http, state.engine.tokenizer)
        add_request = state.engine.client.add_request

        async def spy(request: EngineCoreRequest) -> None:
            app.sent.append(request)
            await add_request(request)

        state.engine.client.add_request = spy
        yield app


@pytest.fixture(scope="module")
def app(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("responses")
    with open_app(
        tiny_checkpoint, folder, enable_auto_tool_choice=True, tool_call_parser="hermes"
    ) as app:
        yield app


def events_of(stream: Any) -> list[Any]:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


# ---- text --------------------------------------------------------------------------------


def test_text_reply_whole_then_get_and_delete(app):
    client = app.client
    response = client.responses.create(
        model=SERVED_NAME,
        input=QUESTION,
        instructions=INSTRUCTIONS,
        max_output_tokens=6,
        temperature=0.0,
        metadata={"case": "whole"},
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.model == SERVED_NAME and response.metadata == {"case": "whole"}
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    (part,) = message.content
    assert part.type == "output_text" and part.text == response.output_text
    usage = response.usage
    assert (
        usage.output_tokens <= 6 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    )
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
        assert message.status == "incomplete" and usage.output_tokens == 6
    else:
        assert response.status == "completed" and message.status == "completed"
    # the instructions are the system message, the input the user's
    text = app.prompt_text(app.sent[-1])
    assert f"<|im_start|>system\n{INSTRUCTIONS}<|im_end|>" in text
    assert text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    # stored: GET gives it back as it was; DELETE forgets it
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(response.id)
    assert e.value.body["message"] == f"Response with id '{response.id}' not found."
    assert_error(app.http.delete(f"/v1/responses/{response.id}"), 404)


def test_text_reply_streamed_event_sequence(app):
    stream = app.client.responses.create(
        model=SERVED_NAME, input=QUESTION, max_output_tokens=5, temperature=0.0, stream=True
    )
    events = events_of(stream)
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    last = (
        "response.incomplete"
        if events[-1].response.status == "incomplete"
        else "response.completed"
    )
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    created, in_progress, added, part_added = events[:4]
    response_id = created.response.id
    assert created.response.status == in_progress.response.status == "in_progress"
    assert created.response.output == []
    item_id = added.item.id
    assert added.output_index == 0 and added.item.status == "in_progress"
    assert part_added.item_id == item_id and part_added.part.text == ""
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert all(
        e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in deltas
    )
    text = "".join(e.delta for e in deltas)
    text_done, part_done, item_done, final = events[-4:]
    assert text_done.text == part_done.part.text == text
    assert item_done.item.content[0].text == text and item_done.item.id == item_id
    assert final.response.id == response_id and final.response.output_text == text
    assert final.response.usage.output_tokens <= 5
    # the stored response is the one the stream ended with
    assert app.client.responses.retrieve(response_id).model_dump() == final.response.model_dump()


# ---- tools -------------------------------------------------------------------------------


def check_call(item: Any) -> dict[str, Any]:
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    assert item.status == "completed"
    arguments = json.loads(item.arguments)
    jsonschema.validate(arguments, CITY)
    return arguments


def test_tool_loop_by_previous_response_id(app):
    client = app.client
    # 1. the call (a named tool_choice: the grammar makes the reply the call)
    first = client.responses.create(
        model=SERVED_NAME,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice=NAMED,
        max_output_tokens=40,
    )
    assert first.status == "completed"
    (call,) = first.output
    arguments = check_call(call)
    assert first.tools[0].strict is True  # OpenAI's default on /v1/responses
    # 2. the tool's result as the next input; the earlier turn comes from the store
    second = client.responses.create(
        model=SERVED_NAME,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
        max_output_tokens=6,
    )
    # 3. the answer: text (tool_choice "auto": the random model writes no call)
    assert [item.type for item in second.output] == ["message"]
    assert second.previous_response_id == first.id and second.tool_choice == "auto"
    text = app.prompt_text(app.sent[-1])
    call_text = f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}'
    assert f"<|im_start|>user\n{QUESTION}<|im_end|>" in text
    assert call_text in text and "<tool_response>\nsunny\n</tool_response>" in text
    # the second turn's prompt starts with the first's, whose pages it reuses
    first_request, second_request = app.sent[-2:]
    assert second_request.prompt_token_ids[: len(first_request.prompt_token_ids)] == (
        first_request.prompt_token_ids
    )
    assert second.usage.input_tokens_details.cached_tokens >= 16
    # both in the first response's KV session, leased for its follow-up
    assert first_request.cache_key == second_request.cache_key == first.id
    assert first_request.cache_ttl_s == second_request.cache_ttl_s == 300.0


def test_tool_loop_streamed_and_stateless(app):
    client = app.client
    with client.responses.stream(
        model=SERVED_NAME,
        input=QUESTION,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        store=False,
    ) as stream:
        events = events_of(stream)
        first = stream.get_final_response()
    types = [e.type for e in events]
    num_deltas = types.count("response.function_call_arguments.delta")
    assert num_deltas >= 1
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done, item_done = events[2], events[-3], events[-2]
    assert added.item.type == "function_call" and added.item.arguments == ""
    assert added.item.call_id == item_done.item.call_id and added.item.name == "get_weather"
    (call,) = first.output
    arguments = check_call(call)
    assert done.arguments == call.arguments and json.loads(done.arguments) == arguments
    assert done.item_id == call.id == added.item.id
    # not stored: no follow-up by id, no GET
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert app.sent[-1].cache_key is None and app.sent[-1].cache_ttl_s is None
    # the whole conversation sent again: the SDK's own output items, then the result
    conversation = [
        {"role": "user", "content": QUESTION},
        *first.output,
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    stream = client.responses.create(
        model=SERVED_NAME,
        input=conversation,
        tools=[WEATHER],
        max_output_tokens=6,
        store=False,
        stream=True,
    )
    answer = events_of(stream)[-1].response  # completed, or incomplete at 6 tokens
    assert [item.type for item in answer.output] == ["message"]
    assert "<tool_response>\nsunny\n</tool_response>" in app.prompt_text(app.sent[-1])


# ---- structured output -------------------------------------------------------------------


class Answer(BaseModel):
    city: str = Field(max_length=8)
    sunny: bool


def test_strict_json_output(app):
    # The SDK's `parse` sends the model's strict JSON schema as text.format and reads it back.
    response = app.client.responses.parse(
        model=SERVED_NAME, input=QUESTION, text_format=Answer, max_output_tokens=60
    )
    assert response.status == "completed", response.output_text
    assert isinstance(response.output_parsed, Answer)
    assert Answer.model_validate_json(response.output_text) == response.output_parsed
    assert response.text.format.type == "json_schema" and response.text.format.strict is True
    # json_object, streamed: the whole text is one JSON object
    stream = app.client.responses.create(
        model=SERVED_NAME,
        input=QUESTION,
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        stream=True,
    )
    final = events_of(stream)[-1]
    if final.type == "response.completed":
        assert isinstance(json.loads(final.response.output_text), dict)


# ---- conversation state ------------------------------------------------------------------


def test_multi_turn_reuses_the_earlier_turns_kv(app):
    client = app.client
    turns, previous = [], None
    instructions = "You answer like a pirate, in few words."  # a prompt no test sent before
    for text in ("Tell me about the city of Zurich.", "And tomorrow?", "Thanks."):
        response = client.responses.create(
            model=SERVED_NAME,
            input=text,
            instructions=instructions,
            previous_response_id=previous,
            max_output_tokens=4,
            temperature=0.0,
        )
        turns.append((response, app.sent[-1]))
        previous = response.id
    (r1, q1), (r2, q2), (r3, q3) = turns
    # each prompt renders the earlier turns (their output too) before its own input
    assert q2.prompt_token_ids[: len(q1.prompt_token_ids)] == q1.prompt_token_ids
    assert r1.output_text in app.prompt_text(q2) and r2.output_text in app.prompt_text(q3)
    assert app.prompt_text(q3).count(instructions) == 1
    assert r1.usage.input_tokens_details.cached_tokens < r2.usage.input_tokens_details.cached_tokens
    assert r2.usage.input_tokens_details.cached_tokens >= len(q1.prompt_token_ids) // 16 * 16
    assert r3.usage.input_tokens_details.cached_tokens >= len(q2.prompt_token_ids) // 16 * 16
    assert q1.cache_key == q2.cache_key == q3.cache_key == r1.id
    # a last turn may be streamed and left unstored: still in the session, not leased, not kept;
    # its cached tokens come in the completed event (instructions are not inherited: sent again,
    # or the template's default system prompt would come first)
    stream = client.responses.create(
        model=SERVED_NAME,
        input="Bye.",
        instructions=instructions,
        previous_response_id=r3.id,
        max_output_tokens=2,
        store=False,
        stream=True,
    )
    final = events_of(stream)[-1].response
    assert final.usage.input_tokens_details.cached_tokens >= len(q3.prompt_token_ids) // 16 * 16
    assert (app.sent[-1].cache_key, app.sent[-1].cache_ttl_s) == (r1.id, None)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(final.id)


# ---- bad input ---------------------------------------------------------------------------


def body(**fields: Any) -> dict[str, Any]:
    return {"model": SERVED_NAME, "input": "hi", "max_output_tokens": 1, **fields}


@pytest.mark.parametrize(
    ("fields", "status", "param", "words"),
    [
        ({"n": 2}, 400, "n", ["Unknown parameter: 'n'."]),
        ({"background": True}, 400, "background", ["background"]),
        ({"include": ["reasoning.encrypted_content"]}, 400, "include", ["include"]),
        ({"truncation": "auto"}, 400, "truncation", ["never truncated"]),
        ({"conversation": "conv_1"}, 400, "conversation", ["previous_response_id"]),
        ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type", ["'web_search'", "function"]),
        ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": 3}}]}, 400, "tools[0].parameters", []),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name", ["'nope'"]),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, 400, "tool_choice.type", []),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, 400, "text.format.schema", []),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format.name", ["text.format.name"]),
        ({"text": {"verbosity": "low"}}, 400, "text.verbosity", []),
        ({"reasoning": {"effort": "high"}}, 400, "reasoning.effort", ["no effort setting"]),
        ({"reasoning": {"summary": "detailed"}}, 400, "reasoning.summary", []),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input[0].content[0].type", ["text-only"]),
        ({"input": [{"type": "computer_call_output"}]}, 400, "input[0].type", []),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, 400, "input[0].call_id", []),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]}, 400, "input", ["not valid JSON"]),
        ({"input": None}, 400, "input", ["input is required"]),
        ({"input": []}, 400, "input", []),
        ({"max_output_tokens": 100000}, 400, "max_output_tokens", ["context length is 1024", "of the input"]),
        ({"max_output_tokens": 0}, 400, "max_output_tokens", ["max_output_tokens must be at least 1"]),
        ({"model": "gpt-5"}, 404, "model", []),
        ({"previous_response_id": "resp_nope"}, 404, "previous_response_id", ["Previous response with id 'resp_nope' not found."]),
        ({"prompt_cache_retention": "forever"}, 400, "prompt_cache_retention", []),
        ({"metadata": {str(i): "v" for i in range(17)}}, 400, "metadata", []),
        ({"temperature": "hot"}, 400, "temperature", []),
    ],
)  # fmt: skip
def test_bad_input_is_an_openai_error_naming_the_field(app, fields, status, param, words):
    error = assert_error(app.http.post("/v1/responses", json=body(**fields)), status, param)
    for word in words:
        assert word in error["message"], error
    if param == "previous_response_id":
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "previous_response_not_found"
    if param == "n":
        assert error["code"] == "unknown_parameter"


def test_bad_input_through_the_sdk(app):
    with pytest.raises(openai.BadRequestError) as e:
        app.client.responses.create(model=SERVED_NAME, input="hi", background=True)
    assert e.value.body["param"] == "background"
    with pytest.raises(openai.NotFoundError) as e:
        app.client.responses.create(model=SERVED_NAME, input="hi", previous_response_id="resp_gone")
    assert e.value.body["code"] == "previous_response_not_found"


def test_no_op_fields_are_accepted(app):
    response = app.http.post(
        "/v1/responses",
        json=body(
            background=False,
            include=[],
            truncation="disabled",
            service_tier="auto",
            max_tool_calls=3,
            user="u1",
            safety_identifier="s1",
            reasoning={"effort": "medium", "summary": "auto"},
            text={"format": {"type": "text"}, "verbosity": "medium"},
            store=False,
        ),
    )
    assert response.status_code == 200, response.text
    assert response.json()["store"] is False and response.json()["max_tool_calls"] == 3
