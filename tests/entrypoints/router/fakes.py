"""Fake engines (aiohttp apps on free local ports) that speak the router's contract, and the router
itself under uvicorn in the same event loop, for the router tests."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from aiohttp import web

from inferengine.core.block_pool import KV_STORED
from inferengine.core.hashing import hash_prompt_blocks
from inferengine.entrypoints.router.app import build_app
from inferengine.entrypoints.router.config import RouterServerConfig

BLOCK_SIZE = 4
TOKENS = ["Hel", "lo", ",", " wor", "ld"]


def fake_ids(text: str) -> list[int]:
    """The fake engines' tokenizer: one id per character."""
    return [ord(c) for c in text]


def sse(payload: Any) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


@dataclass
class FakeEngine:
    """One engine. `fail` makes the next requests fail: "500", "400", "close" (the connection
    drops before any answer), "break" (a stream drops after two events), "hang" (no answer)."""

    name: str
    params: dict | None = None  # what a prefill answer carries (default: names this engine)
    fail: str | None = None
    healthy: bool = True
    stored: list[str] = field(default_factory=list)  # prompts whose blocks /kv_events lists
    bodies: list[dict] = field(default_factory=list)  # every completion body received
    tokenized: int = 0
    aborted: int = 0  # streams whose client left before the end
    url: str = ""
    runner: web.AppRunner | None = None

    async def start(self, port: int = 0) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/kv_events", self._kv_events)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        # handlers end with their client (a hung one too), and stopping waits for none
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.2)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if self.healthy else 503)

    async def _kv_events(self, request: web.Request) -> web.Response:
        hashes = [h for p in self.stored for h in hash_prompt_blocks(fake_ids(p), BLOCK_SIZE)]
        events = [[2, ""], *[[KV_STORED, h.hex()] for h in hashes]]
        answer = {"epoch": "e", "next_seq": 0, "snapshot": True, "events": events}
        return web.json_response({**answer, "block_size": BLOCK_SIZE})

    async def _tokenize(self, request: web.Request) -> web.Response:
        self.tokenized += 1
        body = await request.json()
        text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
        return web.json_response({"tokens": fake_ids(text)})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.fail == "hang":
            await asyncio.sleep(3600)
        if self.fail == "close":
            request.transport.close()  # type: ignore[union-attr]
            return web.Response()
        if self.fail in ("500", "400"):
            error = {"error": {"message": f"{self.name} says no", "code": int(self.fail)}}
            return web.json_response(error, status=int(self.fail))
        transfer = body.get("kv_transfer_params") or {}
        if transfer.get("do_remote_decode"):
            params = self.params if self.params is not None else {"from": self.name}
            reply = {"choices": [{"text": "x"}], "kv_transfer_params": params or None}
            return web.json_response(reply)
        if not body.get("stream"):
            text = "".join(TOKENS[: body.get("max_tokens") or len(TOKENS)])
            return web.json_response({"choices": [{"text": text}], "engine": self.name})
        return await self._stream(request)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i, token in enumerate(TOKENS):
                if self.fail == "break" and i == 2:
                    request.transport.close()  # type: ignore[union-attr]
                    return resp
                await resp.write(sse({"choices": [{"index": 0, "text": token}]}))
                await asyncio.sleep(0.05)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        return resp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def running_router(
    prefill: list[FakeEngine | str], decode: list[FakeEngine | str], **overrides: Any
) -> AsyncIterator[str]:
    """The router over these engines (or URLs), serving on a free port; yields its URL."""
    urls = [[e if isinstance(e, str) else e.url for e in role] for role in (prefill, decode)]
    settings = {"health_check_interval": 0.2, "connect_timeout": 2.0, **overrides}
    config = RouterServerConfig(prefill=urls[0], decode=urls[1], port=free_port(), **settings)
    server = uvicorn.Server(
        uvicorn.Config(build_app(config), port=config.port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def engines(*names: str) -> AsyncIterator[list[FakeEngine]]:
    started = [await FakeEngine(n).start() for n in names]
    try:
        yield started
    finally:
        for e in started:
            await e.stop()


@asynccontextmanager
async def router_client(
    prefill: list[FakeEngine | str], decode: list[FakeEngine | str], **overrides: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """`running_router`, and an HTTP client of it."""
    async with (
        running_router(prefill, decode, **overrides) as url,
        httpx.AsyncClient(base_url=url, timeout=30) as client,
    ):
        yield client
