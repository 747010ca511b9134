"""`bench agent --api`: the agent's turns through chat completions, OpenAI's Responses API and
Anthropic's Messages API, against a stub server that streams each API's documented events (the
Responses endpoint is written against OpenAI's shapes, not against our server): what each
request carries (the conversation as alternating messages, the session's cache fields or
cache_control breakpoint), TTFT taken at the first output event (not at `message_start` or
`response.created`), usage read from each API's own fields, error events as failed turns."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import numpy as np
import pytest
from aiohttp import web

from inferengine.bench.agent import AgentTarget, AgentWorkload, build_sessions, run_agent
from inferengine.bench.agent_apis import APIS, post_stream
from inferengine.bench.cli import per_api
from inferengine.bench.systems import SystemSpec

FIRST_DELAY_S = 0.05  # between the stream's opening event and its first output


def sse(event: dict, named: bool) -> bytes:
    head = f"event: {event['type']}\n" if named else ""
    return f"{head}data: {json.dumps(event)}\n\n".encode()


async def events_for(
    api: str, body: dict, response: web.StreamResponse, pieces: tuple = ("Hel", "lo")
) -> None:
    """The stream each API documents, with its output in `pieces`."""
    if api == "chat":
        for piece in pieces:
            await asyncio.sleep(FIRST_DELAY_S if piece == "Hel" else 0)
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip
        await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
    elif api == "responses":
        resp = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
        await response.write(sse({"type": "response.created", "response": resp}, True))
        await asyncio.sleep(FIRST_DELAY_S)
        for piece in pieces:
            delta = {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0, "delta": piece}  # fmt: skip
            await response.write(sse(delta, True))
        usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 2, "total_tokens": 42}  # fmt: skip
        # OpenAI ends a reply cut at max_output_tokens with response.incomplete
        end = "incomplete" if body.get("model") == "cut" else "completed"
        done = resp | {"status": end, "usage": usage}
        await response.write(sse({"type": f"response.{end}", "response": done}, True))
    else:
        usage = {"input_tokens": 8, "cache_read_input_tokens": 16, "cache_creation_input_tokens": 16, "output_tokens": 0}  # fmt: skip
        start = {"id": "msg_1", "type": "message", "role": "assistant", "content": [], "usage": usage}  # fmt: skip
        await response.write(sse({"type": "message_start", "message": start}, True))
        await response.write(sse({"type": "ping"}, True))
        await asyncio.sleep(FIRST_DELAY_S)
        if pieces:
            block = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}  # fmt: skip
            await response.write(sse(block, True))
        for piece in pieces:
            delta = {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}  # fmt: skip
            await response.write(sse(delta, True))
        if pieces:
            await response.write(sse({"type": "content_block_stop", "index": 0}, True))
        end = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": usage | {"output_tokens": 2}}  # fmt: skip
        await response.write(sse(end, True))
        await response.write(sse({"type": "message_stop"}, True))


@pytest.fixture
def stub():
    """A stub server in a thread: (base URL, the bodies it got, by API)."""
    bodies: dict[str, list[dict]] = {api: [] for api in APIS}
    app = web.Application()

    def handler(api: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            bodies[api].append(body)
            if body.get("model") == "refuse":
                return web.json_response({"type": "error"}, status=400)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            if body.get("model") == "empty":  # EOS at once: no block, no delta
                await events_for(api, body, response, pieces=[])
            elif body.get("model") == "fail":
                error = {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}
                await response.write(sse(error, True))
            else:
                await events_for(api, body, response)
            return response

        return handle

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub"}]})

    app.router.add_get("/v1/models", models)
    for api, path in (("chat", "/v1/chat/completions"), ("responses", "/v1/responses"), ("messages", "/v1/messages")):  # fmt: skip
        app.router.add_post(path, handler(api))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def decode(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


WORKLOAD = AgentWorkload(
    sessions=2,
    turns=3,
    prefix_len=6,
    tool_len_min=2,
    tool_len_max=3,
    output_len=4,
    think_time_s=0.0,
    session_gap_s=0.0,
    num_warmups=1,
)


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_every_turn_goes_through_the_api_with_its_cache_fields(stub, api):
    url, bodies = stub
    ids = np.arange(10, 60)
    sessions = build_sessions(WORKLOAD, ids)
    target = AgentTarget(url, "stub", api=api, decode=decode)
    result = asyncio.run(run_agent(WORKLOAD, target, sessions, ids))
    assert result["api"] == api and result["completed"] == 6 and result["failed"] == 0
    # TTFT is the first output, after the opening events and the stub's pause
    assert result["turn1_median_ttft_ms"] >= FIRST_DELAY_S * 1000 * 0.9
    assert result["later_client_hit_rate"] == pytest.approx(16 / 40)
    assert result["total_input_tokens"] == 6 * 40 and result["total_output_tokens"] == 12
    warmup, *turns = bodies[api]
    assert len(turns) == 6
    by_session = {s.id: s for s in sessions}
    for body in turns:
        assert body["stream"] is True and body["temperature"] == 0.0 and body["model"] == "stub"
        assert "ignore_eos" not in body
        if api == "chat":
            items, key = body["messages"], body["prompt_cache_key"]
            assert body["prompt_cache_retention"] == "1h" and body["max_completion_tokens"] == 4
        elif api == "responses":
            items, key = body["input"], body["prompt_cache_key"]
            assert body["prompt_cache_retention"] == "1h" and body["max_output_tokens"] == 4
            assert body["store"] is False and {i["type"] for i in items} == {"message"}
        else:
            items = body["messages"]
            assert "prompt_cache_key" not in body and body["max_tokens"] == 4
            last = items[-1]["content"]
            assert len(last) == 1 and last[0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
            items = [*items[:-1], {"role": "user", "content": last[0]["text"]}]
            key = next(sid for sid, s in by_session.items() if decode(s.segments[0].tolist()) == items[0]["content"])  # fmt: skip
        assert [i["role"] for i in items] == ["user", "assistant"] * (len(items) // 2) + ["user"]
        segments = by_session[key].segments[: len(items)]
        assert [i["content"] for i in items] == [decode(s.tolist()) for s in segments]
    turn_lengths = sorted(len(b.get("messages") or b.get("input")) for b in turns)
    assert turn_lengths == [1, 1, 3, 3, 5, 5]
    # the warm-up is no session: no cache fields
    assert "prompt_cache_key" not in warmup
    if api == "messages":
        assert isinstance(warmup["messages"][0]["content"], str)


def test_error_events_and_refusals_are_failed_turns(stub):
    url, _ = stub

    async def send(api: str, model: str):
        import aiohttp

        async with aiohttp.ClientSession() as http:
            body = {"model": model, "stream": True}
            return await post_stream(http, api, f"{url}/v1/{'messages' if api == 'messages' else 'responses'}", body, 3, 10)  # fmt: skip

    failed = asyncio.run(send("messages", "fail"))
    assert not failed.success and "overloaded_error" in failed.error
    refused = asyncio.run(send("responses", "refuse"))
    assert not refused.success and refused.error.startswith("HTTP 400")
    ok = asyncio.run(send("messages", "stub"))
    assert ok.success and ok.generated_text == "Hello" and ok.output_tokens == 2
    assert (ok.prompt_len, ok.cached_tokens) == (40, 16)
    assert ok.ttft >= FIRST_DELAY_S * 0.9 and ok.latency >= ok.ttft
    cut = asyncio.run(send("responses", "cut"))
    assert cut.success and cut.generated_text == "Hello" and cut.output_tokens == 2, cut.error
    for api in ("messages", "responses"):  # an empty reply: TTFT at its end, as chat's
        empty = asyncio.run(send(api, "empty"))
        assert empty.success and empty.generated_text == "", empty.error
        assert FIRST_DELAY_S * 0.9 <= empty.ttft <= empty.latency


def test_several_apis_make_one_system_each():
    systems = [SystemSpec("ie", command="serve --port {port}"), SystemSpec("other", base_url="u")]
    out, api_of = per_api(systems, ["messages", "chat"])
    assert [s.name for s in out] == ["ie-messages", "ie-chat", "other-messages", "other-chat"]
    assert api_of == {"ie-messages": "messages", "ie-chat": "chat", "other-messages": "messages", "other-chat": "chat"}  # fmt: skip
    assert out[1].command == "serve --port {port}"
    same, one = per_api(systems, ["chat"])
    assert same == systems and one == {"ie": "chat", "other": "chat"}
