"""What a Messages request hands the engine core, read from an in-process app whose engine-core
client is spied on: count_tokens equals the prompt the engine gets; cache_control marks (on
blocks, tools, the request) arrive as leased breakpoints. And thinking: a server with the
deepseek_r1 reasoning parser (its template opens `<think>`, and the tiny model never closes it,
so the whole reply is thinking) streams `thinking` blocks to the official SDK."""

from __future__ import annotations

import time

import anthropic
import pytest

from inferengine.core.engine_io import EngineCoreRequest
from inferengine.engine.arg_utils import EngineArgs
from inferengine.entrypoints.openai.api_server import build_app
from inferengine.entrypoints.openai.config import ServerConfig
from tests.entrypoints.anthropic.conftest import qwen3_checkpoint
from tests.entrypoints.openai.server import SERVED_NAME

HOUR = {"type": "ephemeral", "ttl": "1h"}
WEATHER = {"name": "get_weather", "input_schema": {"type": "object"}, "cache_control": HOUR}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(TestClient, the EngineCoreRequests sent, the SDK over the TestClient)."""
    from starlette.testclient import TestClient

    folder = qwen3_checkpoint(tmp_path_factory.mktemp("qwen3-r1"))
    args = EngineArgs(
        model=str(folder),
        max_model_len=1024,
        kv_cache_memory=16 << 20,
        served_model_name=SERVED_NAME,
    )
    config = ServerConfig(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1"
    )
    sent: list[EngineCoreRequest] = []
    with TestClient(build_app(args.create_engine_config(), config)) as http:
        deadline = time.monotonic() + 180
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the in-process engine did not start"
            time.sleep(0.1)
        client = http.app.state.server.engine.client
        add_request = client.add_request

        async def spy(request: EngineCoreRequest) -> None:
            sent.append(request)
            await add_request(request)

        client.add_request = spy
        sdk = anthropic.Anthropic(
            base_url="http://testserver", api_key="unused", http_client=http, max_retries=0
        )
        yield http, sent, sdk


def test_count_tokens_is_the_prompt_the_engine_gets(app):
    _, sent, sdk = app
    body = {
        "model": SERVED_NAME,
        "system": "You are terse.",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sun"}],
            },
        ],
        "tools": [WEATHER],
    }
    counted = sdk.messages.count_tokens(**body).input_tokens
    sent.clear()
    sdk.messages.create(max_tokens=2, **body)
    (request,) = sent
    assert len(request.prompt_token_ids) == counted


def test_cache_control_marks_reach_the_core_as_leases(app):
    _, sent, sdk = app
    sent.clear()
    reply = sdk.messages.create(
        model=SERVED_NAME,
        max_tokens=2,
        tools=[WEATHER],  # a mark on a tool leases the prompt to the first message
        system=[{"type": "text", "text": "You are terse."}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hello there", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Weather?"},
        ],
        cache_control={"type": "ephemeral", "ttl": "10m"},  # the last message
        tool_choice={"type": "none"},
    )  # fmt: skip
    (request,) = sent
    lengths = [n for n, _ in request.cache_breakpoints]
    assert [ttl for _, ttl in request.cache_breakpoints] == [3600.0, 300.0, 600.0]
    assert lengths == sorted(lengths) and lengths[-1] < len(request.prompt_token_ids)
    # the last breakpoint's prefix was written: nothing of it was in the cache
    usage = reply.usage
    assert usage.cache_creation_input_tokens == lengths[-1] - usage.cache_read_input_tokens
    total = usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens
    assert total == len(request.prompt_token_ids)


@pytest.mark.parametrize("display", [None, "omitted"])
def test_thinking_streams_as_thinking_blocks(app, display):
    _, _, sdk = app
    thinking = {"type": "enabled", "budget_tokens": 4}
    if display:
        thinking["display"] = display
    with sdk.messages.stream(
        model=SERVED_NAME,
        max_tokens=6,
        messages=[{"role": "user", "content": "Think first."}],
        thinking=thinking,
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events if e.type.startswith("content_block")]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert [(b.type, b.signature) for b in final.content] == [("thinking", "")]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    if display == "omitted":
        assert kinds == ["content_block_start", "content_block_stop"] and not deltas
        assert final.content[0].thinking == ""
    else:
        assert kinds[0] == "content_block_start" and kinds[-1] == "content_block_stop"
        assert set(deltas) == {"thinking_delta"} and final.content[0].thinking
    whole = sdk.messages.create(
        model=SERVED_NAME,
        max_tokens=6,
        messages=[{"role": "user", "content": "Think first."}],
        thinking=thinking,
    )
    assert [b.type for b in whole.content] == ["thinking"]


def test_a_model_that_always_thinks_refuses_thinking_disabled(app):
    http, _, _ = app
    body = {
        "model": SERVED_NAME,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "disabled"},
    }
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "always thinks" in error["message"]
