"""Bad bytes and huge values over real HTTP: lone surrogates and invalid UTF-8 are a 400 naming the
field on a connection that stays usable, malformed JSON says where, and every value echoed back
in an error is a short excerpt.

All against the session's shared server; none of these requests generates.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.entrypoints.openai.server import SERVED_NAME

JSON = {"Content-Type": "application/json"}
GOOD = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 1}
USER = {"role": "user", "content": "hi"}
MAX_ERROR_BYTES = 2048  # an error body, whatever the request echoed

# (url, body with a lone surrogate, the field the 400 names)
SURROGATES = [
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "\ud800"}]},
        "messages[0].content",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udfffb"}]}]},
        "messages[0].content[0].text",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "\udc00", "content": "hi"}]},
        "messages[0].role",
    ),
    ("/v1/completions", {"prompt": "x\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "\ud800"]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", "\udbff"]}, "stop[1]"),
    ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
    ("/v1/completions", {"prompt": "hi", "prompt_cache_key": "k\ud800"}, "prompt_cache_key"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": "\ud800"}, "cache_salt"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\ud800": 1}}, "logit_bias.\\ud800"),
    ("/v1/completions", {"prompt": "hi", "x_unknown\ud800": 1}, "x_unknown\\ud800"),
    ("/v1/generate", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("/detokenize", {"tokens": [1], "model": "\udfff"}, "model"),
]


@pytest.fixture(scope="module")
def client(tiny_server):
    with tiny_server.client() as c:
        yield c


def local_port(response: httpx.Response) -> int:
    """The client's end of the connection the response came on."""
    return response.extensions["network_stream"].get_extra_info("socket").getsockname()[1]


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    assert len(response.content) <= MAX_ERROR_BYTES, len(response.content)
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    return error


def post_json(client: httpx.Client, url: str, body: dict) -> httpx.Response:
    """`body` as JSON with non-ASCII escaped (`\\ud800` stays a lone surrogate's escape)."""
    return client.post(url, content=json.dumps(body).encode(), headers=JSON)


@pytest.mark.parametrize(
    ("url", "body", "param"), SURROGATES, ids=[f"{u.strip('/')}-{p}" for u, _, p in SURROGATES]
)
def test_lone_surrogate_is_a_400_naming_the_field_and_the_connection_stays(
    tiny_server, client, url, body, param
):
    logged = len(tiny_server.output())
    bad = post_json(client, url, body)
    error = assert_error(bad, 400, param)
    assert error["type"] == "invalid_request_error"
    assert "lone UTF-16 surrogate" in error["message"] and error["message"].startswith(param)
    good = client.post("/v1/completions", json=GOOD)
    assert good.status_code == 200, good.text
    assert local_port(good) == local_port(bad)  # the same keep-alive connection
    assert "Traceback" not in tiny_server.output()[logged:]


def test_surrogate_pairs_are_text(client):
    body = {"model": SERVED_NAME, "prompt": "\U0001f600 ok"}
    response = post_json(client, "/tokenize", body)  # json.dumps writes "\ud83d\ude00"
    assert b"\\ud83d\\ude00" in json.dumps(body).encode()
    assert response.status_code == 200, response.text
    assert response.json()["count"] > 0


def test_invalid_utf8_body_is_a_400(client):
    response = client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=JSON)
    error = assert_error(response, 400, None)
    assert "not valid UTF-8" in error["message"] and "byte 12" in error["message"]
    assert client.post("/v1/completions", json=GOOD).status_code == 200


def test_malformed_json_says_what_and_where(client):
    response = client.post(
        "/v1/completions", content=b'{"prompt": "hi"\n "max_tokens": 1}', headers=JSON
    )
    error = assert_error(response, 400, None)
    assert error["message"].startswith(
        "Invalid JSON body: Expecting ',' delimiter at line 2 column 2"
    ), error
    assert client.post("/v1/completions", json=GOOD).status_code == 200


BIG = 7_000_000


@pytest.mark.parametrize(
    ("url", "fields", "param", "echoed"),
    [
        ("/v1/completions", {"guided_regex": "(" + "a" * BIG}, "guided_regex", True),
        ("/v1/completions", {"model": "m" * BIG}, "model", True),
        ("/v1/completions", {"max_tokens": "9" * BIG + "x"}, "max_tokens", False),
        ("/v1/completions", {"prompt_cache_retention": "1" * BIG}, "prompt_cache_retention", True),
        ("/v1/completions", {"logit_bias": {"k" * BIG: "not a number"}}, "logit_bias", True),
        (
            "/v1/chat/completions",
            {"messages": [USER], "tool_choice": "t" * BIG},
            "tool_choice",
            True,
        ),
    ],
    ids=["regex", "model", "max_tokens", "retention", "logit_bias_key", "tool_choice"],
)
def test_huge_values_are_echoed_as_short_excerpts(client, url, fields, param, echoed):
    base = GOOD if url == "/v1/completions" else {"model": SERVED_NAME, "max_tokens": 1}
    response = client.post(url, json=base | fields)
    error = assert_error(response, 404 if param == "model" else 400, param)
    # An echoed value is cut to its start and says how long it was.
    assert ("characters in all)" in error["message"]) == echoed, error


def test_many_validation_errors_are_listed_in_a_bounded_message(client):
    response = client.post("/v1/completions", json=GOOD | {"stop_token_ids": ["x"] * 100_000})
    error = assert_error(response, 400, "stop_token_ids")
    assert "and 99995 more error(s)" in error["message"], error


def test_huge_unknown_field_name_is_cut_in_the_header(client):
    response = client.post("/v1/completions", json=GOOD | {"x" * 1_000_000: 1})
    assert response.status_code == 200, response.text[:500]
    assert len(response.headers["x-unknown-fields"]) < 200


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "Exceeds the limit"),
    ],
    ids=["deep", "long-integer"],
)
def test_json_the_parser_gives_up_on_says_why(client, body, says):
    error = assert_error(client.post("/v1/completions", content=body, headers=JSON), 400, None)
    assert error["message"].startswith("Invalid JSON body: ") and says in error["message"], error


@pytest.mark.parametrize(
    ("url", "fields", "param"),
    [
        # Integers past int64 could not reach the engine (its requests are msgpack).
        ("/v1/completions", {"top_k": 2**70}, "top_k"),
        ("/v1/completions", {"priority": -(2**70)}, "priority"),
        # Arguments of the template's rendering, not variables of the template.
        (
            "/v1/chat/completions",
            {"chat_template_kwargs": {"messages": []}},
            "chat_template_kwargs",
        ),
        ("/tokenize", {"chat_template_kwargs": {"return_dict": True}}, "chat_template_kwargs"),
        # 0 read as "not given" once, and generated to the end of the context
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {"max_tokens": 0}, "max_tokens"),
    ],
    ids=[
        "top_k",
        "priority",
        "chat-messages",
        "tokenize-return_dict",
        "chat-max_completion_tokens-0",
        "chat-max_tokens-0",
    ],
)
def test_values_that_broke_the_server_are_a_400(client, url, fields, param):
    base = GOOD if url == "/v1/completions" else {"model": SERVED_NAME, "messages": [USER]}
    error = assert_error(client.post(url, json=base | fields), 400, param)
    assert error["type"] == "invalid_request_error"
