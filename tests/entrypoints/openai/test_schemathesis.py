"""Schemathesis over the real server's OpenAPI schema (the session's shared server): no request,
however odd, gets a 5xx.

Schemathesis generates each operation's bodies from `/openapi.json` (valid and invalid ones); the
test then poisons half of them: some strings become lone surrogates, half a surrogate pair or
100 000 characters, and some objects get such a key. All are sent on one keep-alive connection,
which must survive every answer. Generation is bounded (at most 4 tokens, n at most 2) so that
the run stays short on two CPU cores, and a named model is mostly the served one; nothing else is
filtered out.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from tests.entrypoints.openai.server import SERVED_NAME

schemathesis = pytest.importorskip("schemathesis")

MAX_EXAMPLES = 20  # per operation
GENERATING = {"/v1/completions", "/v1/chat/completions", "/v1/generate", "/v1/messages"}
POISON = st.sampled_from(
    [
        "\ud800",  # a lone high surrogate
        "ok \udfff",  # a lone low surrogate after text
        "\U0001f600\ud83d",  # a whole pair, then half of one
        "x" * 100_000,
        "",
    ]
)


@pytest.fixture(scope="module")
def connection(tiny_server):
    with tiny_server.client() as client:
        yield client


@pytest.fixture(scope="module")
def api_schema(tiny_server):
    return schemathesis.openapi.from_url(f"{tiny_server.url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def poison(value: Any, data: st.DataObject) -> Any:
    """`value` with some of its strings (and, now and then, a new key) replaced by bad ones."""
    if isinstance(value, str):
        return data.draw(POISON) if data.draw(st.integers(0, 3)) == 0 else value
    if isinstance(value, list):
        return [poison(item, data) for item in value]
    if isinstance(value, dict):
        out = {key: poison(item, data) for key, item in value.items()}
        if data.draw(st.integers(0, 7)) == 0:
            out[data.draw(POISON)] = data.draw(POISON)
        return out
    return value


def bounded(path: str, body: Any, data: st.DataObject) -> Any:
    """A generating request's output cut to a few tokens; its model, when named, mostly the one
    served (a random name is a 404 before anything else is looked at)."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str) and data.draw(st.integers(0, 3)) > 0:
        body["model"] = SERVED_NAME
    if path not in GENERATING:
        return body
    for name in ("max_tokens", "max_completion_tokens", "min_tokens"):
        value = body.get(name)
        too_many = isinstance(value, int) and value > 4
        if too_many or (name == "max_tokens" and not isinstance(value, int)):
            body[name] = 4
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    return body


@schema.given(data=st.data())
@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_no_request_gets_a_5xx(case, data, tiny_server, connection):
    headers = dict(tiny_server.headers)
    content = None
    if isinstance(case.body, bytes):  # a body that is not JSON at all
        content = case.body
    elif case.body is not None and case.body is not schemathesis.core.NOT_SET:
        body = bounded(case.path, case.body, data)
        if data.draw(st.booleans()):
            body = poison(body, data)
        content = json.dumps(body).encode()
    if content is not None:
        headers["Content-Type"] = "application/json"
    response = connection.request(
        case.method, case.formatted_path, content=content, headers=headers
    )
    assert response.status_code < 500, (case.method, case.path, response.text[:2000])
    # A stream that started well must not end in an internal error either.
    anthropic = case.path.startswith("/v1/messages")  # Anthropic's error shape
    internal = '"api_error"' if anthropic else '"internal_error"'
    assert internal not in response.text, (case.path, response.text[:2000])
    if response.status_code >= 400:
        assert len(response.content) <= 2048, (case.path, len(response.content))
        if anthropic:
            assert response.json()["type"] == "error"
            assert set(response.json()["error"]) == {"message", "type"}
        else:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
