"""Every error status over raw HTTP, each in OpenAI's shape `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.entrypoints.openai.server import SERVED_NAME, RemoteServer

MAX_MODEL_LEN = 128
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    s = RemoteServer(
        tiny_checkpoint("qwen3"),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "2",
        "--max-waiting-requests",
        "1",
        "--max-request-body-bytes",
        str(BODY_LIMIT),
    )
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    return error


def completion(**fields) -> dict:
    return {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4} | fields


def test_api_key(server):
    url = f"{server.url}/v1/completions"
    assert_error(httpx.post(url, json=completion()), 401)
    bad = {"Authorization": "Bearer wrong-key"}
    error = assert_error(httpx.post(url, json=completion(), headers=bad), 401)
    assert error["type"] == "authentication_error"
    assert_error(httpx.get(f"{server.url}/v1/models"), 401)
    assert httpx.post(url, json=completion(), headers=server.headers).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_unknown_model_and_route(client):
    error = assert_error(client.post("/v1/completions", json=completion(model="gpt-9")), 404)
    assert "gpt-9" in error["message"] and error["param"] == "model"
    chat = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
    assert_error(client.post("/v1/chat/completions", json=chat), 404)
    assert_error(client.get("/v1/nothing-here"), 404)


def test_body_too_large(client):
    error = assert_error(client.post("/v1/completions", json=completion(prompt="x" * 100_000)), 413)
    assert str(BODY_LIMIT) in error["message"]


def test_prompt_too_long(client):
    ids = list(range(10, 10 + MAX_MODEL_LEN + 5))
    error = assert_error(client.post("/v1/completions", json=completion(prompt=ids)), 400)
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    ids = list(range(10, 110))
    error = assert_error(
        client.post("/v1/completions", json=completion(prompt=ids, max_tokens=50)), 400
    )
    assert error["message"].startswith(
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        "150 tokens (100 in the prompt, 50 in the completion)."
    )
    chat = {"messages": [{"role": "user", "content": "Hello world, " * 10}], "max_tokens": 100}
    error = assert_error(client.post("/v1/chat/completions", json=chat), 400, "max_tokens")
    assert "in the messages" in error["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"n": "many"}, "n"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["hi", 3]}, "prompt"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_bad_parameters(client, fields, param):
    error = assert_error(client.post("/v1/completions", json=completion(**fields)), 400, param)
    assert error["type"] == "invalid_request_error"


def test_bad_chat_parameters(client):
    base = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}]}
    assert_error(client.post("/v1/chat/completions", json=base | {"top_logprobs": 2}), 400)
    assert_error(client.post("/v1/chat/completions", json=base | {"messages": []}), 400)
    tools = [{"type": "function", "function": {"name": "f"}}]  # "auto" needs the tool flags
    assert_error(
        client.post("/v1/chat/completions", json=base | {"tools": tools}), 400, "tool_choice"
    )
    tools = [{"type": "function", "function": {}}]
    response = client.post("/v1/chat/completions", json=base | {"tools": tools})
    assert_error(response, 400, "tools[0].function.name")


def test_malformed_json(client):
    response = client.post(
        "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    error = assert_error(response, 400)
    assert error["param"] is None  # not a character offset
    assert error["message"].startswith("Invalid JSON body: Expecting property name"), error
    assert "line 1 column 2" in error["message"], error


def test_streamed_bad_request_fails_before_the_stream(client):
    response = client.post("/v1/completions", json=completion(top_p=5, stream=True))
    assert_error(response, 400, "top_p")


def test_overloaded_503_with_retry_after(server, client):
    # max_num_seqs 2 + max_waiting_requests 1: three long requests fill the server.
    long = completion(max_tokens=100, ignore_eos=True, stream=True)
    streams = [client.stream("POST", "/v1/completions", json=long) for _ in range(3)]
    responses = [s.__enter__() for s in streams]
    try:
        assert all(r.status_code == 200 for r in responses)
        for stream_mode in (False, True):
            rejected = client.post("/v1/completions", json=completion(stream=stream_mode))
            error = assert_error(rejected, 503)
            assert rejected.headers["Retry-After"].isdigit()
            assert "capacity" in error["message"]
    finally:
        for s in streams:
            s.__exit__(None, None, None)
    # The disconnected streams were aborted, so there is room again.
    for _ in range(50):
        if client.post("/v1/completions", json=completion()).status_code == 200:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the server stayed full after its clients disconnected")
