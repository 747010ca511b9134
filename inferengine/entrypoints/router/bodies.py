"""What the router sends to each kind of engine, and how it reads their streams (no state)."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp

from inferengine.entrypoints.openai.errors import error_body

CHAT_TOKENIZE_FIELDS = (
    "model",
    "messages",
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
)


class Broken(Exception):
    """A stream from a decode engine ended in the middle, or before its first event."""


def unsupported(body: dict[str, Any], chat: bool) -> str | None:
    """Why a request cannot be split into prefill and decode (None: it can)."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "n > 1"
    if chat:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1:
        return "several prompts"
    if body.get("echo") and body.get("logprobs") is not None:
        return "echo with logprobs (prompt logprobs are computed where the prompt is)"
    return None


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """What the prefill engine gets: the prompt, one token to generate, no stream."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    if chat and "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    if "n" in body:
        out["n"] = 1
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    return {**body, "kv_transfer_params": params} if params is not None else body


def max_new_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return value if isinstance(value, int) and value > 0 else 0


def error_event(message: str) -> bytes:
    body = error_body(message, "upstream_error", 502)
    return f"data: {json.dumps(body)}\n\n".encode()


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
    """The SSE events of a response, each whole (`...\\n\\n`); `Broken` if it ends inside
    one."""
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n\n")) >= 0:
            yield buffer[: end + 2]
            buffer = buffer[end + 2 :]
    if buffer.strip():
        raise Broken("the stream ended inside an event")
