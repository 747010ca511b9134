"""The streaming request: SSE parsing, request bodies, TTFT/ITL conventions, usage and failures."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from inferengine.bench.client import RequestInput, SSEDecoder, build_payload, send_request


def test_sse_decoder_handles_split_events_crlf_and_comments():
    d = SSEDecoder()
    assert d.feed(b'data: {"a"') == []
    assert d.feed(b": 1}\n\n: keep-alive\n\ndata: [DO") == ['{"a": 1}']
    assert d.feed(b"NE]\r\n\r\ndata: x\r") == ["[DONE]"]
    assert d.feed(b"\n\r\n") == ["x"]
    assert d.feed(b"data: tail") == []
    assert d.flush() == ["tail"]


def test_payloads():
    req = RequestInput("hello", 1, 7, "m", "http://x/v1/completions", ignore_eos=True)
    assert build_payload(req) == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "prompt": "hello",
        "max_tokens": 7,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    chat = RequestInput("hi", 1, 3, "m", "u", chat=True, temperature=None, extra_body={"top_k": 5})
    body = build_payload(chat)
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_completion_tokens"] == body["max_tokens"] == 3
    assert "temperature" not in body and "ignore_eos" not in body and body["top_k"] == 5


def send(server, chat: bool = False, timeout_s: float | None = None, **kwargs):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    req = RequestInput(
        prompt="one two three",
        prompt_len=99,
        output_len=kwargs.pop("output_len", 6),
        model="fake-model",
        api_url=server.base_url + path,
        chat=chat,
        ignore_eos=kwargs.pop("ignore_eos", True),
    )

    async def go():
        async with aiohttp.ClientSession() as session:
            return await send_request(session, req, timeout_s)

    return asyncio.run(go())


@pytest.mark.parametrize("chat", [False, True])
def test_timings_and_usage(fake_server, chat):
    server = fake_server(ttft_ms=40, token_delay_ms=10)
    out = send(server, chat=chat)
    assert out.success, out.error
    assert out.output_tokens == 6 and out.usage_reported
    assert out.prompt_len == 3  # the server's usage, not the dataset's 99
    assert out.generated_text == " t0 t1 t2 t3 t4 t5"
    # vLLM's convention: every chunk with choices is an event, so the chat role chunk (sent at
    # once) gives the TTFT, and the closing chunk (finish_reason, no text) one more gap.
    if chat:
        assert out.ttft < 0.035
        assert len(out.itl) == 7 and sum(out.itl) >= 0.035 + 0.03
    else:
        assert out.ttft >= 0.035
        assert len(out.itl) == 6 and sum(out.itl) >= 0.03  # five sleeps of 10 ms, give or take
    assert out.latency >= out.ttft + sum(out.itl) - 1e-6
    assert server.state.bodies[-1]["stream_options"] == {"include_usage": True}


def test_chunks_with_several_tokens(fake_server):
    server = fake_server(tokens_per_chunk=3, token_delay_ms=5)
    out = send(server, output_len=7)
    assert out.success and out.output_tokens == 7  # from usage
    assert len(out.itl) == 3  # one gap per chunk (3 + 3 + 1 tokens, then the closing chunk)


def test_without_usage_counts_text_chunks(fake_server):
    server = fake_server(usage=False, tokens_per_chunk=2)
    out = send(server, output_len=6)
    assert out.success and not out.usage_reported
    assert out.output_tokens == 3  # chunks, not tokens: the documented fallback
    assert out.prompt_len == 99  # the dataset's count


def test_eos_is_honoured_without_ignore_eos(fake_server):
    server = fake_server(eos_after=2)
    assert send(server, ignore_eos=False).output_tokens == 2
    assert send(server, ignore_eos=True).output_tokens == 6


def test_failures_come_back_as_errors(fake_server):
    assert "HTTP 500" in send(fake_server(fail_every=1)).error
    dropped = send(fake_server(drop_every=1, token_delay_ms=5))
    assert not dropped.success and dropped.error
    hung = send(fake_server(hang_every=1), timeout_s=0.3)
    assert not hung.success and "timed out" in hung.error
    req = RequestInput("x", 1, 1, "m", "http://127.0.0.1:9/v1/completions")

    async def refused():
        async with aiohttp.ClientSession() as session:
            return await send_request(session, req, 5)

    out = asyncio.run(refused())
    assert not out.success and "Connect" in out.error


async def _serve_then_hang_up(reader, writer):
    """llama-server's habit: answer one request with keep-alive advertised, then hang up
    shortly after, whatever the client sent meanwhile."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.lower().split(b"\r\n")
        if b"content-length" in line
    )
    await reader.readexactly(length)
    events = [
        {"choices": [{"index": 0, "text": "hi"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    ]
    body = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"
    writer.write(
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: keep-alive\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        + f"{len(body):x}\r\n".encode()
        + body
        + b"\r\n0\r\n\r\n"
    )
    await writer.drain()
    await asyncio.sleep(0.02)  # the client has sent its next request on this connection by now
    writer.close()


@pytest.mark.parametrize("concurrency", [1, 4])
def test_servers_that_hang_up_after_each_response(concurrency):
    async def go():
        server = await asyncio.start_server(_serve_then_hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        req = RequestInput("x", 3, 1, "m", f"http://127.0.0.1:{port}/v1/completions")
        connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=60)
        async with server, aiohttp.ClientSession(connector=connector) as session:
            limit = asyncio.Semaphore(concurrency)

            async def one():
                async with limit:
                    return await send_request(session, req, 10)

            return await asyncio.gather(*(one() for _ in range(16)))

    outs = asyncio.run(go())
    assert [o.error for o in outs if not o.success] == []
    assert all(o.output_tokens == 1 for o in outs)
