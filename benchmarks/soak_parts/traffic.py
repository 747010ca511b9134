"""The clients' shared state and their HTTP calls: a JSON POST, a streamed POST (optionally
dropped part-way), the checks that a 200 carries what was asked for, and the guard that gives
each request its timeout and notes how it ended in its Record."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from .outcomes import Record
from .supervisor import Supervisor


@dataclass
class Traffic:
    """Shared state of the clients."""

    base_url: str
    model: str
    args: argparse.Namespace
    t0: float
    supervisor: Supervisor
    records: list[Record] = field(default_factory=list)
    sessions: int = 0
    stopped: bool = False  # set when the traffic's time is up

    def now(self) -> float:
        """Seconds since the run began."""
        return time.monotonic() - self.t0

    def done(self) -> bool:
        """Whether the traffic is over (time up, or --max-requests sent)."""
        return self.stopped or len(self.records) >= self.args.max_requests


def _usage(body: dict, rec: Record) -> None:
    usage = body.get("usage") or {}
    rec.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    rec.cached_tokens = details.get("cached_tokens")


def error_detail(response: httpx.Response) -> str:
    """The error message of a non-200 answer, cut to 160 characters."""
    try:
        err = response.json().get("error", {})
        return str(err.get("message") if isinstance(err, dict) else err)[:160]
    except (ValueError, AttributeError):
        return response.text[:160]


class BadResponse(Exception):
    """A 200 whose body is not what the request asked for."""


async def post_json(client: httpx.AsyncClient, path: str, body: dict, rec: Record) -> dict | None:
    """POST; the parsed body of a 200 (usage recorded), else None with the status noted."""
    response = await client.post(path, json=body)
    rec.status = response.status_code
    if response.status_code != 200:
        rec.detail = error_detail(response)
        return None
    out = response.json()
    _usage(out, rec)
    return out


async def stream(
    client: httpx.AsyncClient, path: str, body: dict, rec: Record, stop_after: int | None = None
) -> list[dict] | None:
    """POST a streamed request; its chunks (None on an HTTP error). With `stop_after`, the
    client drops the connection after that many chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks: list[dict] = []
    async with client.stream("POST", path, json=body) as response:
        rec.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            rec.detail = error_detail(response)
            return None
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"]
                code = err.get("code") if isinstance(err, dict) else None
                rec.status = code if isinstance(code, int) else 500
                rec.error = "stream_error"
                rec.detail = str(err.get("message") if isinstance(err, dict) else err)[:160]
                return None
            chunks.append(chunk)
            if chunk.get("usage"):
                _usage(chunk, rec)
            if stop_after is not None and len(chunks) >= stop_after:
                rec.detail = f"dropped after {len(chunks)} chunks"
                return chunks  # leaving the block closes the connection mid-stream
        if not done:
            raise BadResponse("the stream ended without [DONE]")
    if not any(c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")):
        raise BadResponse("no chunk carried a finish_reason")
    return chunks


def finish_and_message(body: dict) -> tuple[str | None, dict]:
    """The first choice's finish_reason and message."""
    choice = body["choices"][0]
    return choice.get("finish_reason"), choice.get("message") or {}


async def guarded(rec: Record, t: Traffic, coro) -> None:
    """Run one request with the overall timeout; note its outcome in `rec`."""
    try:
        await asyncio.wait_for(coro, t.args.request_timeout_s)
    except TimeoutError:
        rec.error, rec.detail = "timeout", f"no answer within {t.args.request_timeout_s} s"
    except httpx.ConnectError as e:
        rec.error, rec.detail = "connect", type(e).__name__
    except httpx.TimeoutException as e:
        rec.error, rec.detail = "timeout", type(e).__name__
    except httpx.HTTPError as e:
        rec.error, rec.detail = "http", f"{type(e).__name__}: {e}"[:160]
    except BadResponse as e:
        rec.error, rec.detail = "bad_response", str(e)[:160]
    except (ValueError, KeyError, IndexError, TypeError) as e:
        rec.error, rec.detail = "bad_response", f"{type(e).__name__}: {e}"[:160]
    finally:
        rec.end = t.now()
    if rec.error is not None:
        rec.ok = False


def make_client(t: Traffic) -> httpx.AsyncClient:
    """An HTTP client for the server, with the request timeout."""
    timeout = httpx.Timeout(t.args.request_timeout_s, connect=5.0)
    return httpx.AsyncClient(base_url=t.base_url, timeout=timeout)
