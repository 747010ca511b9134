"""One streamed OpenAI-compatible request, timed on the client: TTFT, inter-token gaps, E2E latency.

Conventions (those of vLLM's `bench serve`, except where noted):
- TTFT is the time to the first chunk that carries text. A chat server's role-only first chunk or
  an empty-text chunk does not count (vLLM counts any chunk with `choices`).
- ITL has one entry per text chunk: the gap since the previous text chunk. A chunk that carries
  several tokens gives one (longer) gap, as in vLLM; TPOT divides by the token count instead.
- E2E latency runs from sending the request to the last event of the stream.
- Output and prompt token counts come from the server's `usage` (last chunk); without it the
  output count is the number of text chunks, and `usage_reported` is False.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class RequestInput:
    """What to send: the prompt, how many tokens to ask for, and where."""

    prompt: str | list[int]  # text, or token ids (completions only)
    prompt_len: int
    output_len: int
    model: str
    api_url: str
    chat: bool = False
    ignore_eos: bool = False
    temperature: float | None = 0.0
    extra_body: dict | None = None


@dataclass
class RequestOutput:
    """What came back, with client-side timings in seconds."""

    success: bool = False
    generated_text: str = ""
    prompt_len: int = 0  # the server's usage.prompt_tokens when reported, else the dataset's
    output_tokens: int = 0
    usage_reported: bool = False
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if reported
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # time.perf_counter() when the request was sent
    error: str = ""


def build_payload(req: RequestInput) -> dict:
    """The JSON body of a streamed completion or chat completion request."""
    payload: dict = {"model": req.model, "stream": True, "stream_options": {"include_usage": True}}
    if req.chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
        payload["max_completion_tokens"] = req.output_len
    else:
        payload["prompt"] = req.prompt
    payload["max_tokens"] = req.output_len
    if req.temperature is not None:
        payload["temperature"] = req.temperature
    if req.ignore_eos:
        payload["ignore_eos"] = True
    if req.extra_body:
        payload.update(req.extra_body)
    return payload


class SSEDecoder:
    """Splits a byte stream into the data payloads of its server-sent events."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[str]:
        self._buffer = (self._buffer + data).replace(b"\r\n", b"\n")
        *events, self._buffer = self._buffer.split(b"\n\n")
        return [p for p in map(self._payload, events) if p is not None]

    def flush(self) -> list[str]:
        """Whatever the stream ended with, if it forms an event."""
        rest, self._buffer = self._buffer, b""
        payload = self._payload(rest)
        return [] if payload is None else [payload]

    @staticmethod
    def _payload(event: bytes) -> str | None:
        # Lines starting with ":" are comments (keep-alive pings); only data lines matter.
        lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        return b"\n".join(lines).decode("utf-8") if lines else None


def chunk_text(choice: dict, chat: bool) -> str:
    """The text a streamed choice carries (chat: content, or reasoning for reasoning models)."""
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


class _StreamTimer:
    """Folds the stream's events into a RequestOutput as they arrive."""

    def __init__(self, out: RequestOutput, chat: bool) -> None:
        self.out = out
        self.chat = chat
        self.last_text_at: float | None = None
        self.last_event_at = out.start_time
        self.text_chunks = 0
        self.parts: list[str] = []

    def on_event(self, payload: str, now: float) -> None:
        self.last_event_at = now
        if payload.strip() == "[DONE]":
            return
        data = json.loads(payload)
        if data.get("error") and not data.get("choices"):
            raise RuntimeError(f"server error in stream: {data['error']}")
        choices = data.get("choices") or []
        if choices:
            # vLLM's convention: every chunk with choices is a token event, text or not
            # (a special token, or bytes of an unfinished character, carry no text).
            if self.last_text_at is None:
                self.out.ttft = now - self.out.start_time
            else:
                self.out.itl.append(now - self.last_text_at)
            self.last_text_at = now
            text = chunk_text(choices[0], self.chat)
            if text:
                self.text_chunks += 1
                self.parts.append(text)
        usage = data.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                self.out.output_tokens = int(usage["completion_tokens"])
                self.out.usage_reported = True
            if usage.get("prompt_tokens") is not None:
                self.out.prompt_len = int(usage["prompt_tokens"])
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                self.out.cached_tokens = int(details["cached_tokens"])

    def finish(self) -> None:
        out = self.out
        if self.last_text_at is None:
            out.error = "the stream ended without a single choice chunk"
            return
        if not out.usage_reported:
            out.output_tokens = self.text_chunks
        out.generated_text = "".join(self.parts)
        out.latency = self.last_event_at - out.start_time
        out.success = True


_STALE_TRIES = 1 + 256  # a pool of up to 256 dead connections (the largest concurrency we run)


async def _post(
    session: aiohttp.ClientSession, req: RequestInput, timeout_s: float | None, out: RequestOutput
) -> aiohttp.ClientResponse:
    """POST `req`; again when the connection drops before any byte of a response came back.
    Some servers (llama.cpp's llama-server) close each connection after a response while
    advertising keep-alive, so a pooled connection can be dead when reused, and after a burst
    every pooled one can be: each failed try discards one, so tries are bounded by the pool
    (`_STALE_TRIES`). A request that got no response was not served, so a retry never counts
    one twice."""
    for attempt in range(1, _STALE_TRIES + 1):
        out.start_time = time.perf_counter()
        try:
            return await session.post(
                req.api_url,
                json=build_payload(req),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            )
        except aiohttp.ClientConnectorError:  # no connection at all: nothing stale to retry
            raise
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            if attempt == _STALE_TRIES:
                raise
    raise AssertionError("unreachable")


async def send_request(
    session: aiohttp.ClientSession, req: RequestInput, timeout_s: float | None = None
) -> RequestOutput:
    """Send one streamed request; failures come back as `success=False` with an error text."""
    out = RequestOutput(prompt_len=req.prompt_len)
    try:
        async with await _post(session, req, timeout_s, out) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                out.error = f"HTTP {response.status} {response.reason}: {body}"
                return out
            timer = _StreamTimer(out, req.chat)
            decoder = SSEDecoder()
            async for data in response.content.iter_any():
                now = time.perf_counter()
                for payload in decoder.feed(data):
                    timer.on_event(payload, now)
            for payload in decoder.flush():
                timer.on_event(payload, time.perf_counter())
        timer.finish()
    except TimeoutError:
        out.error = f"timed out after {timeout_s} s"
    except aiohttp.ClientError as e:
        out.error = f"{type(e).__name__}: {e}"
    except (RuntimeError, ValueError) as e:  # error events, malformed JSON
        out.error = f"{type(e).__name__}: {e}"
    return out
