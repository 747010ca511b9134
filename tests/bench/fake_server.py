"""A fake OpenAI-compatible streaming server for the benchmark tests: timed chunks, no model.

Run it as a script (`python tests/bench/fake_server.py --port 8123 --token-delay-ms 2`) or in a
thread with `FakeServer(FakeConfig(...))`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from dataclasses import dataclass, field, fields

from aiohttp import web


@dataclass
class FakeConfig:
    model: str = "fake-model"
    root: str | None = None  # reported by /v1/models (vLLM reports the model's path)
    ttft_ms: float = 2.0
    token_delay_ms: float = 1.0
    tokens_per_chunk: int = 1
    eos_after: int = 3  # without ignore_eos, the "model" ends after this many tokens
    fail_every: int = 0  # every Nth request answers HTTP 500
    drop_every: int = 0  # every Nth request loses its connection halfway
    hang_every: int = 0  # every Nth request sleeps 30 s before answering
    usage: bool = True
    role_chunk: bool = True  # chat: a role-only first chunk, sent at once
    startup_delay_s: float = 0.0  # /health answers 503 until then
    log_requests: bool = False  # print a line per request (to fill a server log)
    spec_counters: bool = False  # /metrics counts 3 drafts of 2 tokens per request, 4 accepted


@dataclass
class FakeState:
    started: float = field(default_factory=time.perf_counter)
    count: int = 0
    active: int = 0
    max_active: int = 0
    bodies: list[dict] = field(default_factory=list)
    # A prefix cache over token-id prompts, counted as vLLM's /metrics does (16-token blocks).
    prefix_queries: int = 0
    prefix_hits: int = 0
    seen: list[list[int]] = field(default_factory=list)

    def look_up(self, ids: list[int]) -> None:
        """Count the longest full-block prefix `ids` shares with an earlier prompt."""
        best = 0
        for old in self.seen:
            n = 0
            while n < min(len(old), len(ids)) and old[n] == ids[n]:
                n += 1
            best = max(best, n // 16 * 16)
        self.prefix_queries += len(ids)
        self.prefix_hits += min(best, (len(ids) - 1) // 16 * 16)
        self.seen.append(ids)


STATE = web.AppKey("state", FakeState)


def make_app(cfg: FakeConfig) -> web.Application:
    state = FakeState()
    app = web.Application()
    app[STATE] = state

    async def health(_: web.Request) -> web.Response:
        ready = time.perf_counter() - state.started >= cfg.startup_delay_s
        return web.json_response({"ok": ready}, status=200 if ready else 503)

    async def models(_: web.Request) -> web.Response:
        entry = {"id": cfg.model, "object": "model", "root": cfg.root or cfg.model}
        return web.json_response({"object": "list", "data": [entry]})

    async def generate(request: web.Request) -> web.StreamResponse:
        state.active += 1
        state.max_active = max(state.max_active, state.active)
        try:
            return await stream(request)
        finally:
            state.active -= 1

    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.count += 1
        n = state.count
        state.bodies.append(body)
        if cfg.log_requests:
            print(f"request {n}: max_tokens={body.get('max_tokens')}", flush=True)
        if cfg.fail_every and n % cfg.fail_every == 0:
            return web.json_response({"error": {"message": "injected failure"}}, status=500)
        if cfg.hang_every and n % cfg.hang_every == 0:
            await asyncio.sleep(30)
        chat = request.path.endswith("chat/completions")
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        length = max_tokens if body.get("ignore_eos") else min(max_tokens, cfg.eos_after)
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if not chat and isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
            state.look_up(prompt)  # token ids
            prompt = " ".join(map(str, prompt))
        elif isinstance(prompt, list):  # content parts, as vLLM's client sends them
            prompt = " ".join(part.get("text", "") for part in prompt)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)

        async def send(payload: dict | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            await response.write(f"data: {data}\n\n".encode())

        def chunk(text: str, finish: str | None = None) -> dict:
            if chat:
                choice = {"index": 0, "delta": {"content": text} if text else {}}
            else:
                choice = {"index": 0, "text": text}
            return {"object": "chunk", "choices": [{**choice, "finish_reason": finish}]}

        if chat and cfg.role_chunk:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            await send({"object": "chunk", "choices": [role]})
        await asyncio.sleep(cfg.ttft_ms / 1000)
        emitted = 0
        while emitted < length:
            k = min(cfg.tokens_per_chunk, length - emitted)
            await send(chunk("".join(f" t{emitted + j}" for j in range(k))))
            emitted += k
            if cfg.drop_every and n % cfg.drop_every == 0 and emitted * 2 >= length:
                assert request.transport is not None
                request.transport.close()
                return response
            if emitted < length:
                await asyncio.sleep(cfg.token_delay_ms / 1000)
        await send(chunk("", "length" if emitted == max_tokens else "stop"))
        if cfg.usage:
            usage = {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": length,
                "total_tokens": len(prompt.split()) + length,
            }
            await send({"object": "chunk", "choices": [], "usage": usage})
        await send("[DONE]")
        await response.write_eof()
        return response

    async def metrics(_: web.Request) -> web.Response:
        labels = f'{{engine="0",model_name="{cfg.model}"}}'
        lines = [
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{labels} {float(state.prefix_queries)}",
            f"vllm:prefix_cache_hits_total{labels} {float(state.prefix_hits)}",
            f"vllm:prefix_cache_hits_created{labels} 1.7e9",
        ]
        if cfg.spec_counters:
            for name, per_request in (
                ("num_drafts", 3),
                ("num_draft_tokens", 6),
                ("num_accepted_tokens", 4),
            ):
                lines.append(f"vllm:spec_decode_{name}_total{labels} {per_request * state.count}.0")
        return web.Response(text="\n".join(lines) + "\n")

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    return app


class FakeServer:
    """The fake server on 127.0.0.1 and an ephemeral port, in a thread with its own loop."""

    def __init__(self, cfg: FakeConfig | None = None) -> None:
        self.cfg = cfg or FakeConfig()
        self.app = make_app(self.cfg)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> FakeState:
        return self.app[STATE]

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self.app, shutdown_timeout=0.2)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = self._runner.addresses[0][1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())

    def __enter__(self) -> FakeServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    for f in fields(FakeConfig):
        kind = {"float": float, "int": int, "bool": int}.get(str(f.type), str)
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=f.default)
    args = vars(parser.parse_args())
    port = args.pop("port")
    web.run_app(make_app(FakeConfig(**args)), host="127.0.0.1", port=port, print=None)


if __name__ == "__main__":
    main()
