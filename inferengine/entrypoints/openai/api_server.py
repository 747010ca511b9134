"""The OpenAI-compatible FastAPI app (routes, engine start-up in the background) and its runner."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from inferengine.config import EngineConfig
from inferengine.engine.async_llm import AsyncLLM
from inferengine.entrypoints.anthropic.errors import AnthropicErrors
from inferengine.entrypoints.anthropic.routes import router as anthropic_router
from inferengine.entrypoints.openai.config import ServerConfig
from inferengine.entrypoints.openai.errors import (
    ServiceUnavailableError,
    install_error_handlers,
    status_response,
)
from inferengine.entrypoints.openai.lora_routes import adapter_cards, server_loras
from inferengine.entrypoints.openai.lora_routes import router as lora_router
from inferengine.entrypoints.openai.middleware import GateMiddleware
from inferengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenizeRequest,
)
from inferengine.entrypoints.openai.responses.routes import install as install_responses
from inferengine.entrypoints.openai.serving_chat import ServingChat
from inferengine.entrypoints.openai.serving_completions import ServingCompletion
from inferengine.entrypoints.openai.serving_embedding import router as pooling_router
from inferengine.entrypoints.openai.serving_engine import (
    RequestLimits,
    ascii_name,
    unknown_fields,
)
from inferengine.entrypoints.openai.serving_score import router as score_router
from inferengine.entrypoints.openai.serving_tokens import ServingTokens
from inferengine.entrypoints.web import mount_web_ui
from inferengine.errors import EngineDeadError
from inferengine.logger import init_logger
from inferengine.metrics.prometheus import PrometheusStatLogger
from inferengine.metrics.stats import StatLogger

logger = init_logger(__name__)

UNKNOWN_FIELDS_HEADER = "X-Unknown-Fields"
CUT_OFF_WAIT_S = 1.0  # after a drain's cut-off, how long its requests get to send their 503
# uvicorn's own grace when it stops: our drain has already ended every API request, so it only
# closes idle connections (a short /health or /metrics call may still be running).
UVICORN_GRACE_S = 1
# What stopping takes once the drain's requests are ended (uvicorn's shutdown, the engine core's
# exit, the process's): the drain cuts off this much before --drain-timeout, so that the whole
# time from the signal to the process's exit is --drain-timeout.
SHUTDOWN_RESERVE_S = 0.3
ENGINE_WATCH_S = 0.1  # how often the server checks that its engine still runs
DEAD_ENGINE_GRACE_S = 1.0  # once the engine died, how long failed requests get to say so
STATS_MAX_SESSIONS = 100  # /stats lists the sessions whose leases end last, up to this many


def make_engine(config: EngineConfig, stat_loggers: list[StatLogger]) -> AsyncLLM:
    """The server's engine: one engine core, or data-parallel replicas (`inferengine/dp/`)."""
    if config.parallel_config.data_parallel_size > 1:
        from inferengine.dp.llm import DataParallelLLM  # Ray, only for data parallelism

        return DataParallelLLM(config, stat_loggers)
    return AsyncLLM(config, stat_loggers)


@dataclass(frozen=True)
class Handlers:
    """The endpoint handlers, built once the engine is up."""

    completions: ServingCompletion
    chat: ServingChat
    tokens: ServingTokens


class ServerState:
    """The app's state: the engine once started, its handlers, and the server's status."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig):
        self.engine_config = engine_config
        self.config = config
        self.api_key = config.api_key
        self.max_request_body_bytes = config.max_request_body_bytes
        mc, sc = engine_config.model_config, engine_config.scheduler_config
        self.metrics = PrometheusStatLogger(
            mc.name, mc.max_model_len, sc.max_num_batched_tokens, engine_config.device
        )
        # A mixture-of-experts model: /metrics asks the engine for its expert counts.
        self.serves_moe = bool(
            mc.hf_config.get("num_local_experts") or mc.hf_config.get("num_experts")
        )
        self.engine: AsyncLLM | None = None
        self.status = "starting"  # starting -> ready -> draining; or failed
        self.error: str | None = None
        self.draining = False
        self.in_flight = 0  # API requests being served (see GateMiddleware)
        self.cut_off = asyncio.Event()  # the drain's time is up: GateMiddleware ends requests
        self.started_at = time.time()
        self.loras = server_loras(engine_config, config.lora_modules)  # adapters by name
        self.on_ready: Callable[[ServerState], None] | None = None
        # Called when the server cannot serve any more (the engine failed to start, or died):
        # the runner stops the server with a non-zero exit code, for a supervisor to restart it.
        self.on_fatal: Callable[[str], None] | None = None
        self.handlers: Handlers | None = None
        self._watcher: asyncio.Task | None = None

    async def start_engine(self) -> None:
        try:
            engine = await asyncio.to_thread(make_engine, self.engine_config, [self.metrics])
            self.engine = engine
            await engine.start()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"
            logger.error("the engine failed to start: %s", self.error)
            if self.on_fatal is not None:
                self.on_fatal(f"the engine failed to start: {self.error}")
            return
        config = self.config
        log_requests = config.enable_log_requests
        max_num_seqs = self.engine_config.scheduler_config.max_num_seqs
        limits = RequestLimits(
            max_n=config.max_n,
            max_request_seqs=config.max_request_seqs or 64 * max_num_seqs,
            max_log_len=config.max_log_len,
        )
        chat = ServingChat(
            engine,
            log_requests,
            limits,
            enable_auto_tools=config.enable_auto_tool_choice,
            tool_parser=config.tool_call_parser,
            reasoning_parser=config.reasoning_parser,
            exclude_tools_when_tool_choice_none=config.exclude_tools_when_tool_choice_none,
        )
        self.handlers = Handlers(
            ServingCompletion(engine, log_requests, limits),
            chat,
            ServingTokens(engine, log_requests, limits),
        )
        for handler in (chat, self.handlers.completions, self.handlers.tokens):
            handler.loras = self.loras  # a request's `model` may name an adapter
        self.status = "ready"
        self._watcher = asyncio.create_task(self._watch_engine(engine))
        if self.on_ready is not None:
            self.on_ready(self)

    async def _watch_engine(self, engine: AsyncLLM) -> None:
        """Once the engine dies (with data-parallel replicas: once none is left), let the failed
        requests send their error, then stop the server: it would answer 503 forever, where a
        supervisor (systemd, Kubernetes) restarts a process that exits."""
        while engine.is_running:
            await asyncio.sleep(ENGINE_WATCH_S)
        message = (
            f"engine core died ({engine.dead_reason}); shutting down the API server so a "
            "supervisor can restart it"
        )
        logger.error("%s", message)
        deadline = time.monotonic() + DEAD_ENGINE_GRACE_S
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.on_fatal is not None:
            self.on_fatal(message)

    def check_serving(self) -> AsyncLLM:
        """The engine, or the 503 error that says why requests cannot be served now."""
        if self.status == "starting":
            raise ServiceUnavailableError("The engine is still starting; retry shortly.")
        if self.status == "failed":
            raise EngineDeadError(f"The engine failed to start: {self.error}")
        assert self.engine is not None
        if not self.engine.is_running:
            raise EngineDeadError(f"The engine is not running ({self.engine.dead_reason}).")
        return self.engine

    def serving(self) -> Handlers:
        """The endpoint handlers, or the 503 error that says why requests cannot be served."""
        self.check_serving()
        assert self.handlers is not None
        return self.handlers

    def unavailable_reason(self) -> str | None:
        if self.draining:
            return "The server is shutting down."
        try:
            self.check_serving()
        except (ServiceUnavailableError, EngineDeadError) as e:
            return e.message
        return None

    async def drain(self, timeout: float, since: float | None = None) -> None:
        """Refuse new requests (503) and let in-flight ones finish until `timeout` s after
        `since` (the signal's `time.monotonic()`; default now), less `SHUTDOWN_RESERVE_S` for
        stopping; then (or as soon as `cut_off` is set: a second signal) end the rest with a 503."""
        self.draining = True
        if self.status == "ready":
            self.status = "draining"
        start = time.monotonic() if since is None else since
        deadline = start + max(0.0, timeout - SHUTDOWN_RESERVE_S)
        logger.info(
            "draining: %d request(s) in flight, waiting up to %g s", self.in_flight, timeout
        )
        while self.in_flight > 0 and time.monotonic() < deadline and not self.cut_off.is_set():
            await asyncio.sleep(0.05)
        if self.in_flight == 0:
            return
        logger.warning("drain: ending %d request(s) still in flight with 503", self.in_flight)
        self.cut_off.set()
        deadline = time.monotonic() + CUT_OFF_WAIT_S
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()  # stopping the engine here is no death
        if self.engine is not None:
            self.engine.shutdown()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _reply(result: Any, body: SamplingFields) -> Response:
    """The handler's result as a response; ignored request fields named in `X-Unknown-Fields`."""
    response = result if isinstance(result, Response) else _json(result)
    unknown = unknown_fields(body)
    if unknown:
        response.headers[UNKNOWN_FIELDS_HEADER] = ", ".join(ascii_name(n) for n in unknown)[:2048]
    return response


router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    reason = _state(request).unavailable_reason()
    if reason is not None:
        return status_response(503, reason)
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def version() -> Response:
    from inferengine import __version__

    return JSONResponse({"version": __version__})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    engine = state.engine
    if engine is not None and engine.is_running and state.status != "starting":
        try:
            await engine.refresh_stats()
            state.metrics.update_scheduler_stats(engine.scheduler_stats)
            if state.engine_config.device == "cuda" and engine.client is not None:
                used = await engine.client.call_utility("device_memory", timeout=2.0)
                if used is not None:
                    state.metrics.set_gpu_memory_used(int(used))
            if engine.client is not None and state.serves_moe:
                counts = await engine.client.call_utility("expert_token_counts", timeout=2.0)
                state.metrics.update_expert_token_counts(counts)
        except Exception as e:  # a scrape must not fail because the core is busy or gone
            logger.debug("metrics: could not refresh engine stats: %s", e)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/stats")
async def stats(request: Request) -> Response:
    state = _state(request)
    engine = state.check_serving()
    await engine.refresh_stats()
    body = engine.get_stats()
    body.update(await engine.client.call_utility("activity", STATS_MAX_SESSIONS))
    body["engine_pid"] = engine.ready_info.get("pid")
    body["server_status"] = state.status
    body["server_in_flight"] = state.in_flight
    return JSONResponse(body)


@router.get("/kv_events")
async def kv_events(request: Request, since: int = 0, epoch: str | None = None) -> Response:
    """The engine's KV events from number `since` on, or a snapshot (`core/kv_event_log.py`):
    what `inferengine router` replays to know which prefixes this engine holds."""
    state = _state(request)
    engine = state.check_serving()
    try:
        answer = await engine.client.call_utility("kv_events", since, epoch, timeout=10.0)
    except RuntimeError as e:
        return status_response(501, f"no KV events here: {e}")
    answer["events"] = [[kind, bytes(h).hex()] for kind, h in answer["events"]]
    answer["block_size"] = state.engine_config.cache_config.block_size
    return JSONResponse(answer)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    mc = _state(request).engine_config.model_config
    card = ModelCard(
        id=mc.name,
        created=int(_state(request).started_at),
        root=mc.model_path,
        max_model_len=mc.max_model_len,
    )
    adapters = adapter_cards(_state(request).loras, card.created)
    return _json(ModelList(data=[card, *adapters]))


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return _reply(await _state(request).serving().completions.create(body, request), body)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return _reply(await _state(request).serving().chat.create(body, request), body)


@router.post("/v1/generate", response_model=None)
async def generate(body: GenerateRequest, request: Request) -> Response:
    return _reply(await _state(request).serving().tokens.generate(body, request), body)


@router.post("/tokenize", response_model=None)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    return _json(_state(request).serving().tokens.tokenize(body))


@router.post("/detokenize", response_model=None)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    return _json(_state(request).serving().tokens.detokenize(body))


def build_app(engine_config: EngineConfig, config: ServerConfig | None = None) -> FastAPI:
    """The app; its lifespan starts the engine in the background (`/health` is 503 until then)."""
    state = ServerState(engine_config, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(state.start_engine())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            state.shutdown()

    app = FastAPI(title="InferEngine", lifespan=lifespan)
    app.state.server = state
    app.include_router(router)
    app.include_router(pooling_router)  # /v1/embeddings (serving_embedding.py)
    app.include_router(score_router)  # /v1/score, /v1/rerank (serving_score.py)
    app.include_router(lora_router)  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    install_responses(app, state.config)
    if not state.config.disable_web_ui:
        mount_web_ui(app)
    app.include_router(anthropic_router)
    app.add_middleware(GateMiddleware, state=state)
    app.add_middleware(AnthropicErrors)  # outermost: reshapes the gate's errors too
    install_error_handlers(app)
    return app


# ---- running under uvicorn -------------------------------------------------------------------


class DrainingServer(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT drains in-flight requests first (the whole
    time from the signal to exit is `--drain-timeout` s at most; a second signal ends the drain
    at once), then exits with 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._signalled_at = 0.0

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if self._draining:
            assert loop is not None
            loop.call_soon_threadsafe(self.state.cut_off.set)
            return
        if loop is None or self.state.status != "ready":
            super().handle_exit(sig, frame)  # nothing to drain
            return
        self._draining = True
        self._signalled_at = time.monotonic()
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.state.config.drain_timeout, self._signalled_at)
        finally:
            self.should_exit = True


async def run_server(
    engine_config: EngineConfig,
    config: ServerConfig,
    on_ready: Callable[[ServerState], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0), or until the engine fails to start or dies
    (1)."""
    app = build_app(engine_config, config)
    state: ServerState = app.state.server
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=config.uvicorn_log_level,
        access_log=config.access_log,
        timeout_graceful_shutdown=UVICORN_GRACE_S,
        lifespan="on",
    )
    server = DrainingServer(uv_config, state)
    failures: list[str] = []

    def on_fatal(message: str) -> None:
        failures.append(message)
        server.should_exit = True

    state.on_fatal = on_fatal
    state.on_ready = on_ready
    await server.serve()
    if failures:
        print(f"error: {failures[0]}", file=sys.stderr)
        return 1
    return 0
