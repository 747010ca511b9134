"""`bench agent --api`: one agent turn sent through OpenAI's completions, chat completions or
Responses API, or Anthropic's Messages API, streamed and timed alike.

`completions` sends the conversation as token ids (the agent bench's original form, comparable
with any OpenAI-compatible server). The other three send text: each segment of the conversation
(prefix, reply, tool output, ...) decoded once from its ids, as alternating messages that start
and end with the user's (the prefix, then reply t as the assistant's, tool output t+1 as the
user's), so every text API sees the same conversation and, through the same chat template, the
same prompt. They send no `ignore_eos` (the Responses and Messages APIs have none), so a reply
may end early; greedy decoding makes it end alike on every API. Session caching, per API:

    completions, chat   prompt_cache_key = the session, prompt_cache_retention
    responses           the same two fields of OpenAI's Responses API (`store` false)
    messages            a cache_control breakpoint {"type": "ephemeral", "ttl": retention} on
                        the last user block: the whole conversation so far is leased

TTFT is the time to the first event that carries output: a chunk with choices (chat, vLLM's
rule), a `response.*.delta` (Responses), a `content_block_delta` (Messages); for a reply that
is empty (EOS at once), the event that ends it (`response.completed`, or `response.incomplete`
when it ran out of tokens; `message_delta`), as chat's finish chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import numpy as np

from inferengine.bench.client import (
    RequestInput,
    RequestOutput,
    SSEDecoder,
    _StreamTimer,
    send_request,
)

APIS = ("completions", "chat", "responses", "messages")
PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
Sender = Callable[[Sequence[np.ndarray], "str | None"], Awaitable[RequestOutput]]


def turns_of(texts: Sequence[str]) -> list[tuple[str, str]]:
    """(role, text) of a conversation's segments: the user's first, then alternating."""
    return [("user" if i % 2 == 0 else "assistant", text) for i, text in enumerate(texts)]


def chat_payload(model: str, texts: Sequence[str], output_len: int, cache: dict) -> dict:
    messages = [{"role": role, "content": text} for role, text in turns_of(texts)]
    return {
        "model": model,
        "messages": messages,
        "max_completion_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **cache,
    }


def responses_payload(model: str, texts: Sequence[str], output_len: int, cache: dict) -> dict:
    items = [{"type": "message", "role": r, "content": t} for r, t in turns_of(texts)]
    return {
        "model": model,
        "input": items,
        "max_output_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "store": False,
        **cache,
    }


def messages_payload(model: str, texts: Sequence[str], output_len: int, ttl: str | None) -> dict:
    """Anthropic's Messages request; `ttl` None: no cache_control breakpoint."""
    messages: list[dict[str, Any]] = [{"role": r, "content": t} for r, t in turns_of(texts)]
    if ttl is not None:
        last = messages[-1]
        mark = {"type": "ephemeral", "ttl": ttl}
        last["content"] = [{"type": "text", "text": last["content"], "cache_control": mark}]
    return {
        "model": model,
        "messages": messages,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
    }


# The event that ends a reply; for a reply without output it is the first output, as chat's
# finish chunk is (a chunk with choices).
_REPLY_ENDS = ("message_delta", "response.completed", "response.incomplete")


class _EventTimer:
    """Folds a Responses or Messages event stream into a RequestOutput (see `_StreamTimer`)."""

    def __init__(self, out: RequestOutput, api: str) -> None:
        self.out = out
        self.api = api
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.last_event_at = out.start_time
        self.parts: list[str] = []
        self.chunks = 0
        self.done = False

    def on_event(self, payload: str, now: float) -> None:
        self.last_event_at = now
        data = json.loads(payload)
        kind = data.get("type", "")
        if kind in ("error", "response.failed"):
            raise RuntimeError(f"server error in stream: {data.get('error') or data}")
        if self.api == "messages":
            text = self._messages(kind, data)
        else:
            text = self._responses(kind, data)
        if text is None:
            if kind in _REPLY_ENDS and self.first_at is None:  # an empty reply (EOS at once)
                self.first_at = now
                self.out.ttft = now - self.out.start_time
            return
        if self.first_at is None:
            self.first_at = now
            self.out.ttft = now - self.out.start_time
        else:
            self.out.itl.append(now - (self.last_at or now))
        self.last_at = now
        self.chunks += 1
        self.parts.append(text)

    def _messages(self, kind: str, data: dict) -> str | None:
        if kind == "message_start":
            self._usage((data.get("message") or {}).get("usage") or {})
        elif kind == "message_delta":
            self._usage(data.get("usage") or {})
        elif kind == "message_stop":
            self.done = True
        elif kind == "content_block_delta":
            delta = data.get("delta") or {}
            return delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
        return None

    def _usage(self, usage: dict) -> None:
        if usage.get("output_tokens") is not None:
            self.out.output_tokens = int(usage["output_tokens"])
            self.out.usage_reported = True
        counts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]  # fmt: skip
        if counts[0] is not None:
            self.out.prompt_len = sum(int(c or 0) for c in counts)
            self.out.cached_tokens = int(counts[1] or 0)

    def _responses(self, kind: str, data: dict) -> str | None:
        if kind.endswith(".delta") and kind.startswith("response."):
            return str(data.get("delta") or "")
        if kind in ("response.completed", "response.incomplete"):  # incomplete: max tokens
            self.done = True
            usage = (data.get("response") or {}).get("usage") or {}
            if usage.get("output_tokens") is not None:
                self.out.output_tokens = int(usage["output_tokens"])
                self.out.usage_reported = True
            if usage.get("input_tokens") is not None:
                self.out.prompt_len = int(usage["input_tokens"])
            details = usage.get("input_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                self.out.cached_tokens = int(details["cached_tokens"])
        return None

    def finish(self) -> None:
        out = self.out
        if self.first_at is None:
            out.error = "the stream ended without a single output event"
            return
        if not self.done:
            out.error = "the stream ended before its last event (message_stop, response.completed)"
            return
        if not out.usage_reported:
            out.output_tokens = self.chunks
        out.generated_text = "".join(self.parts)
        out.latency = self.last_event_at - out.start_time
        out.success = True


async def post_stream(
    http: aiohttp.ClientSession,
    api: str,
    url: str,
    payload: dict,
    prompt_len: int,
    timeout_s: float | None,
    headers: dict[str, str] | None = None,
) -> RequestOutput:
    """One streamed request of a text API, timed; failures as `success=False` with an error."""
    out = RequestOutput(prompt_len=prompt_len)
    timer: Any = _StreamTimer(out, chat=True) if api == "chat" else _EventTimer(out, api)
    try:
        out.start_time = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with http.post(url, json=payload, timeout=timeout, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                out.error = f"HTTP {response.status} {response.reason}: {body}"
                return out
            decoder = SSEDecoder()
            async for data in response.content.iter_any():
                now = time.perf_counter()
                for event in decoder.feed(data):
                    timer.on_event(event, now)
            for event in decoder.flush():
                timer.on_event(event, time.perf_counter())
        timer.finish()
    except TimeoutError:
        out.error = f"timed out after {timeout_s} s"
    except (aiohttp.ClientError, RuntimeError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def make_sender(
    api: str,
    http: aiohttp.ClientSession,
    base_url: str,
    model: str,
    workload: Any,
    extra_body: dict,
    send_ignore_eos: bool,
    decode: Callable[[list[int]], str] | None,
) -> Sender:
    """`send(segments, session_key)`: one turn whose prompt is the segments' concatenation."""
    url = f"{base_url}{PATHS[api]}"
    retention = workload.prompt_cache_retention
    timeout_s = workload.request_timeout_s
    texts: dict[bytes, str] = {}  # decoded segments

    def cache_fields(key: str | None) -> dict:
        if key is None or not workload.cache_fields:
            return {}
        return {"prompt_cache_key": key} | (
            {"prompt_cache_retention": retention} if retention else {}
        )

    def text(segment: np.ndarray) -> str:
        assert decode is not None, f"--api {api} sends text: it needs a tokenizer to decode"
        key = segment.tobytes()
        if key not in texts:
            texts[key] = decode(segment.tolist())
        return texts[key]

    async def send(segments: Sequence[np.ndarray], key: str | None) -> RequestOutput:
        prompt_len = sum(len(s) for s in segments)
        if api == "completions":
            request = RequestInput(
                prompt=np.concatenate(list(segments)).tolist(),
                prompt_len=prompt_len,
                output_len=workload.output_len,
                model=model,
                api_url=url,
                ignore_eos=send_ignore_eos,
                temperature=0.0,
                extra_body=(dict(extra_body) | cache_fields(key)) or None,
            )
            return await send_request(http, request, timeout_s)
        strings = [text(s) for s in segments]
        if api == "chat":
            payload = chat_payload(model, strings, workload.output_len, cache_fields(key))
        elif api == "responses":
            payload = responses_payload(model, strings, workload.output_len, cache_fields(key))
        else:
            lease = retention if key is not None and workload.cache_fields else None
            ttl = None if lease in (None, "in_memory") else lease
            payload = messages_payload(model, strings, workload.output_len, ttl)
        return await post_stream(http, api, url, payload | extra_body, prompt_len, timeout_s)

    return send
