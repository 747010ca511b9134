"""Request fields the server does not implement are a 400 naming them; harmless ones are accepted.

One case per refusal, all against the session's shared server (no generation happens for a 400).
"""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.server import SERVED_NAME

COMPLETIONS, CHAT, GENERATE = "/v1/completions", "/v1/chat/completions", "/v1/generate"
_BODIES = {
    COMPLETIONS: {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 1},
    CHAT: {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    GENERATE: {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 1},
}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (url, fields, the param the error names)
REFUSED = [
    # (tool calling on chat: test_tools_api.py and test_tools_e2e.py)
    (COMPLETIONS, {"tools": [_TOOL]}, "tools"),
    (COMPLETIONS, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"functions": [_TOOL["function"]]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    (CHAT, {"web_search_options": {}}, "web_search_options"),
    (CHAT, {"reasoning_effort": "low"}, "reasoning_effort"),
    (CHAT, {"echo": True}, "echo"),
    (GENERATE, {"echo": True}, "echo"),
    (CHAT, {"best_of": 2}, "best_of"),
    (COMPLETIONS, {"best_of": 3}, "best_of"),
    (COMPLETIONS, {"suffix": " end"}, "suffix"),
    (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
    (COMPLETIONS, {"length_penalty": 0.5}, "length_penalty"),
    (COMPLETIONS, {"guided_whitespace_pattern": r"[ ]?"}, "guided_whitespace_pattern"),
    (CHAT, {"structural_tag": "{}"}, "structural_tag"),
    (COMPLETIONS, {"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    (COMPLETIONS, {"bad_words": ["Hello"]}, "bad_words"),
    (COMPLETIONS, {"logits_processors": ["my.module:Proc"]}, "logits_processors"),
    (COMPLETIONS, {"truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    (COMPLETIONS, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (GENERATE, {"prompt_logprobs": 1}, "prompt_logprobs"),
    (COMPLETIONS, {"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    (CHAT, {"return_token_ids": True}, "return_token_ids"),
    (CHAT, {"add_special_tokens": True}, "add_special_tokens"),
    (CHAT, {"documents": [{"title": "t", "text": "x"}]}, "documents"),
    (COMPLETIONS, {"priority": 1}, "priority"),  # the shared server schedules fcfs
    (
        COMPLETIONS,
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        "stream_options",
    ),
]


@pytest.fixture(scope="module")
def client(tiny_server):
    with tiny_server.client() as c:
        yield c


@pytest.mark.parametrize(
    ("url", "fields", "param"), REFUSED, ids=[f"{u.split('/')[-1]}-{p}" for u, _, p in REFUSED]
)
def test_unsupported_field_is_a_400_naming_it(client, url, fields, param):
    response = client.post(url, json=_BODIES[url] | fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    name = "continuous_usage_stats" if param == "stream_options" else param
    says = "needs priority scheduling" if param == "priority" else "is not supported"
    assert name in error["message"] and says in error["message"], error


@pytest.mark.parametrize(
    ("url", "fields"),
    [
        # Values that ask for nothing, as some clients send them.
        (CHAT, {"functions": None, "function_call": "none", "modalities": ["text"]}),
        (CHAT, {"tools": [_TOOL], "tool_choice": "none"}),  # the model is told not to call
        (CHAT, {"tool_choice": "none", "response_format": {"type": "text"}, "echo": False}),
        (COMPLETIONS, {"tool_choice": "auto", "functions": []}),
        (COMPLETIONS, {"best_of": 1, "use_beam_search": False, "length_penalty": 1.0}),
        (COMPLETIONS, {"priority": 0, "guided_json": None, "bad_words": []}),
        # Harmless to ignore: they change nothing about the reply.
        (CHAT, {"user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto"}),
        (CHAT, {"parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"}}),
        (COMPLETIONS, {"request_id": "abc", "some_unknown_field": 1}),
    ],
)
def test_inert_and_harmless_fields_are_accepted(client, url, fields):
    response = client.post(url, json=_BODIES[url] | fields)
    assert response.status_code == 200, response.text


def test_unknown_fields_are_named_in_a_response_header(client):
    body = _BODIES[COMPLETIONS] | {"some_unknown_field": 1, "user": "u1", "best_of": 1}
    response = client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-unknown-fields"] == "some_unknown_field"
    plain = client.post(COMPLETIONS, json=_BODIES[COMPLETIONS])
    assert "x-unknown-fields" not in plain.headers
