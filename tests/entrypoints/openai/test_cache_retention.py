"""Session retention over HTTP: `prompt_cache_key` / `prompt_cache_retention` on both generating
endpoints and Anthropic's `cache_control` on chat messages reach `EngineCoreRequest`; bad values
are OpenAI-shaped 400s naming the field and saying what is accepted.

Errors and acceptance go to the session's shared server; what reaches the engine core is read
from an in-process app whose engine-core client is spied on.
"""

from __future__ import annotations

import time

import pytest

from inferengine.core.engine_io import EngineCoreRequest
from inferengine.engine.arg_utils import EngineArgs
from inferengine.entrypoints.openai.api_server import build_app
from inferengine.entrypoints.openai.config import ServerConfig
from tests.entrypoints.openai.conftest import MAX_MODEL_LEN
from tests.entrypoints.openai.server import SERVED_NAME
from tests.entrypoints.openai.test_errors import assert_error

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HOUR = {"type": "ephemeral", "ttl": "1h"}


def body(url: str, **fields) -> dict:
    if url == COMPLETIONS:
        return {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 1} | fields
    messages = [{"role": "user", "content": "hi"}]
    return {"model": SERVED_NAME, "messages": messages, "max_tokens": 1} | fields


def marked(cache_control, where: str = "part") -> list[dict]:
    """A conversation with one `cache_control` mark on the first message (or on its part)."""
    if where == "message":
        first = {"role": "system", "content": "You answer briefly.", "cache_control": cache_control}
    else:
        part = {"type": "text", "text": "You answer briefly.", "cache_control": cache_control}
        first = {"role": "system", "content": [part]}
    return [first, {"role": "user", "content": "Paris is the capital of"}]


@pytest.fixture(scope="module")
def client(tiny_server):
    with tiny_server.client() as c:
        yield c


# ---- refused -------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [COMPLETIONS, CHAT])
@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("forever", ["'forever' is not understood", '"in_memory"', '"600s"', '"1h"', '"24h"']),
        ("10", ["with a unit"]),
        ("0s", ["out of range"]),
        ("30d", ["out of range", "7 days"]),
        (600, ['"in_memory"', '"600s"']),
    ],
)
def test_bad_prompt_cache_retention_is_a_400_naming_it(client, url, value, words):
    response = client.post(url, json=body(url, prompt_cache_retention=value))
    error = assert_error(response, 400, "prompt_cache_retention")
    assert error["type"] == "invalid_request_error"
    assert "prompt_cache_retention" in error["message"]
    for word in words:
        assert word in error["message"], error


@pytest.mark.parametrize(
    ("cache_control", "where", "param", "words"),
    [
        ({"type": "persistent"}, "part", "messages[0].content[0].cache_control.type", ["'persistent'"]),
        ({"ttl": "1h"}, "part", "messages[0].content[0].cache_control.type", ["None"]),
        ("ephemeral", "part", "messages[0].content[0].cache_control", ["must be an object"]),
        ({"type": "ephemeral", "ttl": "1 week"}, "part", "messages[0].content[0].cache_control.ttl", ["not understood", '"600s"']),
        ({"type": "ephemeral", "ttl": "in_memory"}, "part", "messages[0].content[0].cache_control.ttl", ["must be a duration"]),
        ({"type": "ephemeral", "ttl": 300}, "part", "messages[0].content[0].cache_control.ttl", ["must be a string"]),
        ({"type": "ephemeral", "max_age": 5}, "part", "messages[0].content[0].cache_control", ["unknown field(s) ['max_age']"]),
        ({"type": "persistent"}, "message", "messages[0].cache_control.type", ["'persistent'"]),
    ],
)  # fmt: skip
def test_bad_cache_control_is_a_400_saying_what_is_accepted(
    client, cache_control, where, param, words
):
    response = client.post(CHAT, json=body(CHAT, messages=marked(cache_control, where)))
    error = assert_error(response, 400, param)
    assert error["message"].startswith(param.removesuffix(".type").removesuffix(".ttl"))
    if not param.endswith(".ttl"):
        assert '{"type": "ephemeral"}' in error["message"] and '"5m"' in error["message"]
    for word in words:
        assert word in error["message"], error


# ---- accepted ------------------------------------------------------------------------------


@pytest.mark.parametrize("url", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("value", [None, "in_memory", "600s", "1h", "24h"])
def test_good_prompt_cache_retention_is_accepted(client, url, value):
    response = client.post(url, json=body(url, prompt_cache_key="s1", prompt_cache_retention=value))
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "cache_control", [{"type": "ephemeral"}, HOUR, {"type": "ephemeral", "ttl": "5m"}]
)
@pytest.mark.parametrize("where", ["part", "message"])
def test_good_cache_control_is_accepted(client, cache_control, where):
    response = client.post(CHAT, json=body(CHAT, messages=marked(cache_control, where)))
    assert response.status_code == 200, response.text


def test_tokenize_ignores_cache_control(client):
    plain = client.post("/tokenize", json={"messages": marked(None)}).json()
    with_mark = client.post("/tokenize", json={"messages": marked(HOUR)}).json()
    assert with_mark["tokens"] == plain["tokens"]


# ---- what reaches the engine core ----------------------------------------------------------


@pytest.fixture(scope="module")
def spied_app(tiny_checkpoint):
    """An in-process app (`TestClient`) and the `EngineCoreRequest`s its engine sends."""
    from starlette.testclient import TestClient

    args = EngineArgs(
        model=str(tiny_checkpoint("qwen3")),
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory=16 << 20,
        served_model_name=SERVED_NAME,
    )
    app = build_app(args.create_engine_config(), ServerConfig())
    sent: list[EngineCoreRequest] = []
    with TestClient(app) as http:
        deadline = time.monotonic() + 180
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the in-process engine did not start"
            time.sleep(0.1)
        engine = app.state.server.engine
        add_request = engine.client.add_request

        async def spy(request: EngineCoreRequest) -> None:
            sent.append(request)
            await add_request(request)

        engine.client.add_request = spy
        yield http, sent, engine.tokenizer


def post(spied_app, url: str, payload: dict) -> list[EngineCoreRequest]:
    http, sent, _ = spied_app
    sent.clear()
    response = http.post(url, json=payload)
    assert response.status_code == 200, response.text
    return list(sent)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_retention_reaches_the_core(spied_app, stream):
    payload = body(
        COMPLETIONS,
        prompt=["Hello", "Paris is"],
        n=2,
        prompt_cache_key="session-1",
        prompt_cache_retention="1.5h",
        stream=stream,
    )
    requests = post(spied_app, COMPLETIONS, payload)
    assert len(requests) == 4  # 2 prompts × n = 2, every one with the request's retention
    for request in requests:
        assert request.cache_key == "session-1"
        assert request.cache_ttl_s == 5400.0
        assert request.cache_breakpoints == []


def test_in_memory_retention_is_no_lease(spied_app):
    payload = body(CHAT, prompt_cache_key="s", prompt_cache_retention="in_memory")
    (request,) = post(spied_app, CHAT, payload)
    assert (request.cache_key, request.cache_ttl_s, request.cache_breakpoints) == ("s", None, [])
    (request,) = post(spied_app, CHAT, body(CHAT))
    assert (request.cache_key, request.cache_ttl_s, request.cache_breakpoints) == (None, None, [])


def test_chat_breakpoints_reach_the_core(spied_app):
    _, _, tokenizer = spied_app
    messages = [
        {"role": "system", "content": "You answer briefly.", "cache_control": HOUR},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Paris is the capital of France."},
                {"type": "text", "text": "Hello world", "cache_control": {"type": "ephemeral"}},
            ],
        },
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "how are you today?"},
    ]
    payload = body(CHAT, messages=messages, prompt_cache_key="s2", prompt_cache_retention="24h")
    (request,) = post(spied_app, CHAT, payload)

    # What the server renders: text parts joined by newlines, marks taken out.
    flat = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Paris is the capital of France.\nHello world"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "how are you today?"},
    ]

    def ids(conversation: list[dict], add_generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return tokenizer.encode(text, add_special_tokens=False)

    assert request.prompt_token_ids == ids(flat, True)
    first, second = ids(flat[:1], False), ids(flat[:2], False)
    assert request.cache_key == "s2" and request.cache_ttl_s == 86400.0
    assert request.cache_breakpoints == [(len(first), 3600.0), (len(second), 300.0)]
    assert request.prompt_token_ids[: len(second)] == second
    assert len(second) < len(request.prompt_token_ids)
