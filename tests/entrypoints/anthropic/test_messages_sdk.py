"""The official `anthropic` SDK against `inferengine serve`, unchanged (base_url = the server):
`messages.create`, `messages.stream` and `messages.count_tokens`, a whole tool loop (tool_use ->
tool_result -> answer) streamed and not, a multi-turn conversation whose `cache_control` marks
make later turns read the cache, a JSON-schema output, stop sequences, and both ways of sending
the key."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import pytest

from tests.entrypoints.openai.server import API_KEY, SERVED_NAME

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
GREEDY = {"temperature": 0.0}  # the SDK has no temperature argument; the API does
NO_THINKING = {"type": "disabled"}  # Qwen3's template: no <think> block, the grammar at once


def total_input(usage) -> int:
    """What the prompt was in all: Anthropic splits it into three counts."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_create_replies_with_a_message(client):
    reply = client.messages.create(
        model=SERVED_NAME, max_tokens=12, messages=[{"role": "user", "content": "Hello"}]
    )
    assert isinstance(reply, anthropic.types.Message)
    assert reply.id.startswith("msg_") and reply.model == SERVED_NAME and reply.role == "assistant"
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= reply.usage.output_tokens <= 12
    if reply.stop_reason == "max_tokens":
        assert reply.usage.output_tokens == 12
    count = client.messages.count_tokens(
        model=SERVED_NAME, messages=[{"role": "user", "content": "Hello"}]
    )
    assert total_input(reply.usage) == count.input_tokens > 0


def test_stream_gathers_what_the_stream_sent(client):
    with client.messages.stream(
        model=SERVED_NAME,
        max_tokens=12,
        system="You answer briefly.",
        messages=[{"role": "user", "content": "Tell me about Paris."}],
        extra_body=GREEDY,
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == text != ""
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens <= 12
    whole = client.messages.create(
        model=SERVED_NAME,
        max_tokens=12,
        system="You answer briefly.",
        messages=[{"role": "user", "content": "Tell me about Paris."}],
        extra_body=GREEDY,
    )
    assert [(b.type, b.text) for b in whole.content] == [("text", text)]  # greedy: the same
    assert (whole.stop_reason, whole.usage.output_tokens) == (
        final.stop_reason,
        final.usage.output_tokens,
    )


def turn(client, messages, stream: bool, **kwargs):
    """One assistant turn, as an agent takes it: the final `Message`."""
    fields = {"model": SERVED_NAME, "max_tokens": 60, "messages": messages, "tools": TOOLS}
    fields |= {"extra_body": GREEDY} | kwargs
    if not stream:
        return client.messages.create(**fields)
    with client.messages.stream(**fields) as events:
        kinds = [event.type for event in events]
        final = events.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    return final


@pytest.mark.parametrize("stream", [False, True])
def test_a_whole_tool_loop(client, stream):
    messages = [QUESTION]
    first = turn(
        client,
        messages,
        stream,
        tool_choice={"type": "tool", "name": "get_weather"},
        thinking=NO_THINKING,
    )
    assert first.stop_reason == "tool_use", first
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    jsonschema.validate(call.input, CITY)
    messages = [
        *messages,
        {"role": "assistant", "content": first.content},  # the SDK's own blocks, sent back
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}],
        },
    ]
    answer = turn(client, messages, stream, max_tokens=8, thinking=NO_THINKING)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.content
    # The call and its result are in the prompt: a longer one than the question's with the call.
    assert total_input(answer.usage) > total_input(first.usage) + first.usage.output_tokens
    count = client.messages.count_tokens(
        model=SERVED_NAME, messages=messages, tools=TOOLS, thinking=NO_THINKING
    )
    assert count.input_tokens == total_input(answer.usage)


def test_tool_choice_any_without_parallel_calls_calls_one_tool(client):
    # under the grammar the reply is [{"name": ..., "parameters": {...}}], of one item here
    choice = {"type": "any", "disable_parallel_tool_use": True}
    reply = turn(client, [QUESTION], False, max_tokens=80, tool_choice=choice, thinking=NO_THINKING)
    assert reply.stop_reason == "tool_use", reply
    assert [(b.type, b.name) for b in reply.content] == [("tool_use", "get_weather")]
    jsonschema.validate(reply.content[0].input, CITY)


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_output_is_valid_json_of_the_schema(client, stream):
    """output_config.format (Anthropic's structured outputs): the reply's text is the schema's
    JSON, held there by the same grammar chat's response_format uses."""
    kwargs = dict(
        model=SERVED_NAME,
        max_tokens=60,
        messages=[QUESTION],
        output_config={"format": {"type": "json_schema", "schema": CITY}},
        thinking=NO_THINKING,
        extra_body=GREEDY,
    )
    if stream:
        with client.messages.stream(**kwargs) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**kwargs)
    assert [b.type for b in reply.content] == ["text"], reply
    assert reply.stop_reason == "end_turn", reply
    jsonschema.validate(json.loads(reply.content[0].text), CITY)


def test_cache_control_makes_later_turns_read_the_cache(client):
    system = [
        {
            "type": "text",
            "text": "You are a weather assistant. " * 20,
            "cache_control": {"type": "ephemeral"},
        }
    ]
    messages: list = []
    usages = []
    for question in ("Weather in Paris?", "And in Rome?", "And in Oslo?"):
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}
                ],
            }
        )
        reply = client.messages.create(
            model=SERVED_NAME, max_tokens=6, system=system, messages=messages, extra_body=GREEDY
        )
        usages.append(reply.usage)
        text = "".join(b.text for b in reply.content if b.type == "text") or "ok"
        messages.append({"role": "assistant", "content": text})
    first, *later = usages
    assert first.cache_creation_input_tokens > 0  # the marked prefix was written
    for usage in later:
        assert usage.cache_read_input_tokens > 0, usage
        # at least the system prompt and the first question were read back
        assert usage.cache_read_input_tokens >= first.cache_creation_input_tokens // 2


def test_stop_sequences_end_the_reply(client):
    fields = {
        "model": SERVED_NAME,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Count to ten."}],
        "extra_body": GREEDY,
    }
    text = client.messages.create(**fields).content[0].text
    stop = text[len(text) // 2 :][:2]
    assert stop.strip()
    reply = client.messages.create(stop_sequences=[stop, "never-seen-here"], **fields)
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    assert reply.content[0].text == text[: text.index(stop)]


def test_the_key_goes_as_x_api_key_or_as_a_bearer_token(messages_server):
    url = messages_server.url
    ask = {"model": SERVED_NAME, "max_tokens": 1, "messages": [QUESTION]}
    by_header = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    assert by_header.messages.create(**ask).usage.output_tokens == 1
    by_bearer = anthropic.Anthropic(base_url=url, auth_token=API_KEY, max_retries=0)
    assert by_bearer.messages.count_tokens(model=SERVED_NAME, messages=[QUESTION]).input_tokens
    wrong = anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(**ask)
    assert caught.value.status_code == 401
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert "x-api-key" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        by_header.messages.create(**(ask | {"model": "claude-opus-4"}))
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert "claude-opus-4" in json.dumps(caught.value.body)
