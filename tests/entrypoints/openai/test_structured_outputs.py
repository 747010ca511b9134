"""Structured output end to end through the official `openai` client against the tiny random
model: only the grammar can make its text valid, so every output that finishes must hold.

The 100 samples of each case are one request with n=100 (sampled at temperature 1.0).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tests.entrypoints.openai.server import SERVED_NAME

MESSAGES = [{"role": "user", "content": "Describe a pet as JSON."}]
# Strings and the array are bounded so a random model's output fits in max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
}
SAMPLED = {"temperature": 1.0, "seed": 1}


def _chat(openai_client, n: int, max_tokens: int = 200, **kwargs) -> list[tuple[str, str]]:
    out = openai_client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, n=n, max_tokens=max_tokens, **SAMPLED, **kwargs
    )
    assert len(out.choices) == n
    return [(c.message.content, c.finish_reason) for c in out.choices]


def _check_json(outputs: list[tuple[str, str]], least_finished: int) -> None:
    finished = [text for text, reason in outputs if reason == "stop"]
    assert len(finished) >= least_finished, [reason for _, reason in outputs]
    for text in finished:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_schema_response_format(openai_client):
    _check_json(_chat(openai_client, 100, response_format=RESPONSE_FORMAT), 90)


def test_choice_every_time(openai_client):
    choices = ["red", "green", "blue"]
    outputs = _chat(openai_client, 100, extra_body={"structured_outputs": {"choice": choices}})
    assert all(reason == "stop" and text in choices for text, reason in outputs), outputs


def test_regex_every_time(openai_client):
    pattern = r"[a-z]{3}-[0-9]{2}"
    outputs = _chat(openai_client, 100, extra_body={"structured_outputs": {"regex": pattern}})
    assert all(reason == "stop" and re.fullmatch(pattern, text) for text, reason in outputs), (
        outputs
    )


def test_guided_fields_still_work(openai_client):
    outputs = _chat(openai_client, 10, extra_body={"guided_choice": ["yes", "no"]})
    assert all(text in ("yes", "no") for text, _ in outputs)


def test_json_object(openai_client):
    outputs = _chat(openai_client, 20, response_format={"type": "json_object"})
    finished = [text for text, reason in outputs if reason == "stop"]
    assert finished, outputs
    assert all(isinstance(json.loads(text), dict) for text in finished)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_matches_full(openai_client, endpoint):
    if endpoint == "chat":
        create = openai_client.chat.completions.create
        kwargs = {"messages": MESSAGES, "response_format": RESPONSE_FORMAT}
    else:  # the client's completions take response_format in the body only
        create = openai_client.completions.create
        kwargs = {"prompt": "A pet as JSON:", "extra_body": {"response_format": RESPONSE_FORMAT}}
    kwargs |= dict(model=SERVED_NAME, max_tokens=200, **SAMPLED)
    full = create(**kwargs)
    choice = full.choices[0]
    full_text = choice.message.content if endpoint == "chat" else choice.text
    streamed, reason = "", None
    for chunk in create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed += (c.delta.content or "") if endpoint == "chat" else c.text
            reason = c.finish_reason or reason
    assert streamed == full_text
    assert reason == choice.finish_reason
    if reason == "stop":
        jsonschema.validate(json.loads(full_text), SCHEMA)


def test_completions_json_schema(openai_client):
    out = openai_client.completions.create(
        model=SERVED_NAME,
        prompt="A pet as JSON:",
        n=20,
        max_tokens=200,
        extra_body={"response_format": RESPONSE_FORMAT},
        **SAMPLED,
    )
    _check_json([(c.text, c.finish_reason) for c in out.choices], 18)
