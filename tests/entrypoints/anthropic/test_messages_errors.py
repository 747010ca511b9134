"""Errors on the Messages routes come in Anthropic's shape, `{"type": "error", "error": {"type",
"message"}}`, with the matching status: validation (unknown fields refused as Anthropic refuses
them, a 400 naming the field), what this server does not do (images, server tools, ...), the
API key (x-api-key or a bearer token), the model, the wrong method or path; chat keeps OpenAI's."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.openai.server import SERVED_NAME

HELLO = [{"role": "user", "content": "Hello"}]
BODY = {"model": SERVED_NAME, "max_tokens": 4, "messages": HELLO}
WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}}


def anthropic_error(response: httpx.Response, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body.keys() == {"type", "error"} and body["type"] == "error", body
    assert body["error"].keys() == {"type", "message"}, body
    assert body["error"]["type"] == error_type, body
    return body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (BODY | {"foo": 1}, ["foo: Extra inputs are not permitted"]),
        ({"model": SERVED_NAME, "messages": HELLO}, ["max_tokens: Field required"]),
        (BODY | {"temperature": 1.5}, ["temperature", "less than or equal to 1"]),
        (BODY | {"messages": []}, ["messages"]),
        (BODY | {"messages": [{"role": "system", "content": "x"}]}, ["messages.0.role"]),
        (BODY | {"max_tokens": 0}, ["max_tokens must be at least 1"]),
        (BODY | {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, ["messages.0.content.0", "image", "not supported yet"]),
        (BODY | {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "bold": True}]}]}, ["messages.0.content.0.bold: Extra inputs are not permitted"]),
        (BODY | {"system": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]}, ["system.0.cache_control.type", "'forever'"]),
        (BODY | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, ["tools.0.type", "only custom tools"]),
        (BODY | {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, ["'nope'", "not in tools"]),
        (BODY | {"tool_choice": {"type": "any"}}, ["tool_choice needs tools"]),
        (BODY | {"tool_choice": {"type": "sometimes"}}, ["tool_choice.type", "'sometimes'"]),
        (BODY | {"thinking": {"type": "enabled", "budget_tokens": 8}}, ["budget_tokens", "less than max_tokens"]),
        (BODY | {"container": "c-1"}, ["container: not supported"]),
        (BODY | {"output_config": {"effort": "high"}}, ["output_config.effort"]),
        (BODY | {"cache_control": {"type": "ephemeral"}, "system": [{"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(4)]}, ["A maximum of 4 blocks with cache_control"]),
    ],
)  # fmt: skip
def test_bad_requests_are_400_invalid_request_errors(http, body, words):
    message = anthropic_error(http.post("/v1/messages", json=body), 400, "invalid_request_error")
    for word in words:
        assert word in message, message


def test_bodies_that_are_not_json_or_too_long_prompts(http):
    response = http.post(
        "/v1/messages", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert "Invalid JSON" in anthropic_error(response, 400, "invalid_request_error")
    long = BODY | {"messages": [{"role": "user", "content": "Paris " * 1200}]}
    message = anthropic_error(http.post("/v1/messages", json=long), 400, "invalid_request_error")
    assert "maximum context length" in message


def test_count_tokens_errors_are_anthropic_shaped_too(http):
    response = http.post(
        "/v1/messages/count_tokens", json={"model": SERVED_NAME, "messages": HELLO, "max_tokens": 3}
    )
    assert "max_tokens: Extra inputs are not permitted" in anthropic_error(
        response, 400, "invalid_request_error"
    )
    response = http.post("/v1/messages/count_tokens", json={"model": "other", "messages": HELLO})
    assert "other" in anthropic_error(response, 404, "not_found_error")


def test_key_model_method_and_path(messages_server, http):
    with httpx.Client(base_url=messages_server.url, timeout=30) as anonymous:
        message = anthropic_error(
            anonymous.post("/v1/messages", json=BODY), 401, "authentication_error"
        )
        assert "x-api-key" in message
        wrong = anonymous.post("/v1/messages", json=BODY, headers={"x-api-key": "sk-nope"})
        anthropic_error(wrong, 401, "authentication_error")
        # chat keeps OpenAI's shape
        chat = anonymous.post("/v1/chat/completions", json=BODY)
        assert chat.status_code == 401 and chat.json()["error"]["type"] == "authentication_error"
    assert "claude-3" in anthropic_error(
        http.post("/v1/messages", json=BODY | {"model": "claude-3"}), 404, "not_found_error"
    )
    anthropic_error(http.get("/v1/messages"), 405, "invalid_request_error")
    anthropic_error(http.post("/v1/messages/batches", json={}), 404, "not_found_error")
    assert http.post("/v1/messages", json=BODY).status_code == 200
