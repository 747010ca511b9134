"""The prefill/decode router's FastAPI app (OpenAI routes, /health, /metrics) and its runner."""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from inferengine.dp.pd_policy import PDPolicy, PDPolicyConfig
from inferengine.dp.router import RouterConfig
from inferengine.entrypoints.openai.errors import install_error_handlers, status_response
from inferengine.entrypoints.router.config import RouterServerConfig
from inferengine.entrypoints.router.metrics import RouterMetrics
from inferengine.entrypoints.router.proxy import Proxy
from inferengine.entrypoints.router.upstreams import Upstreams
from inferengine.logger import init_logger

logger = init_logger(__name__)

UVICORN_GRACE_S = 5  # on SIGTERM, how long open streams get to end


class RouterState:
    """The app's parts: the policy, the engines and the proxy over them."""

    def __init__(self, config: RouterServerConfig):
        self.config = config
        self.policy = PDPolicy(
            len(config.prefill),
            len(config.decode),
            PDPolicyConfig(prefill=RouterConfig(policy=config.policy)),
        )
        self.upstreams = Upstreams(config, self.policy)
        self.metrics = RouterMetrics(self.upstreams, self.policy)
        self.proxy = Proxy(config, self.upstreams, self.policy, self.metrics)
        self._key = config.api_key.encode() if config.api_key else None

    def authorized(self, request: Request) -> bool:
        if self._key is None:
            return True
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), self._key)


def _state(request: Request) -> RouterState:
    return request.app.state.router


async def _proxied(request: Request, path: str) -> Response:
    state = _state(request)
    if not state.authorized(request):
        return status_response(
            401, "Invalid or missing API key; send `Authorization: Bearer <key>`."
        )
    try:
        body = json.loads(await request.body())
    except (ValueError, RecursionError) as e:
        return status_response(400, f"Invalid JSON body: {e}.")
    if not isinstance(body, dict):
        return status_response(400, "The request body must be a JSON object.")
    return await state.proxy.handle(path, body, request)


def build_app(config: RouterServerConfig) -> FastAPI:
    state = RouterState(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.upstreams.start()
        try:
            yield
        finally:
            await state.upstreams.stop()

    app = FastAPI(title="InferEngine router", lifespan=lifespan)
    app.state.router = state
    install_error_handlers(app)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await _proxied(request, "/v1/completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await _proxied(request, "/v1/chat/completions")

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> Response:
        """The first engine that answers: decode engines, then prefill ones."""
        if not state.authorized(request):
            return status_response(401, "Invalid or missing API key.")
        headers = state.upstreams.auth_headers(request.headers.get("authorization"))
        session = state.upstreams.session
        assert session is not None
        for engine in sorted(state.upstreams.all, key=lambda e: (not e.up, e.role != "decode")):
            try:
                async with session.get(
                    f"{engine.url}/v1/models",
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=config.connect_timeout),
                ) as resp:
                    if resp.status == 200 or 400 <= resp.status < 500:
                        return Response(
                            await resp.read(), resp.status, media_type="application/json"
                        )
            except (aiohttp.ClientError, TimeoutError):
                continue
        return status_response(503, "No engine answers /v1/models.")

    @app.get("/health")
    async def health() -> Response:
        """200 while a decode engine is up (prefill engines are optional: without one, decode
        engines compute prompts themselves)."""
        policy = state.policy
        counts = {"prefill_up": policy.num_prefill_up, "decode_up": policy.num_decode_up}
        if not counts["decode_up"]:
            return status_response(503, "No decode engine is up.")
        return JSONResponse({"status": "ok", **counts})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def run_router(config: RouterServerConfig) -> None:
    """Serve until SIGTERM/SIGINT."""
    app = build_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.uvicorn_log_level,
            access_log=False,
            timeout_graceful_shutdown=UVICORN_GRACE_S,
            lifespan="on",
        )
    )
    logger.info(
        "router on http://%s:%d: prefill %s, decode %s",
        config.host,
        config.port,
        ", ".join(config.prefill),
        ", ".join(config.decode),
    )
    await server.serve()
