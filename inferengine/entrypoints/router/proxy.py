"""The router's request path: prefill on one engine, decode on another, relayed to the client.

1. Prefill: the body with `max_tokens` 1, `stream` false and `kv_transfer_params`
   `{"do_remote_decode": true}` goes to the prefill engine `PDPolicy` picks; the
   `kv_transfer_params` of its answer are the handle to the prompt's pages. An engine that
   cannot be reached, times out, or answers 5xx/429 is excluded and another tried; when none is
   left, or one answered 4xx or without the handle, the request is decoded without it (the
   decode engine computes the prompt: counted and logged as a fallback, never an error).
   Requests the protocol cannot carry (n > 1, several prompts, echo with logprobs) go to a
   decode engine whole, as to a plain engine.
2. Decode: the client's own body plus the handle goes to the least loaded decode engine. A
   failure before the first byte reaches the client (unreachable, 5xx/429, a stream that ends
   before its first event) is retried on another decode engine, without the handle unless the
   engine never took the request. Once a stream has started, a failure ends it with an
   OpenAI-shaped error event and `[DONE]`.

A client that leaves closes the upstream connection, which aborts the request in the engine.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from inferengine.dp.pd_policy import PDPolicy
from inferengine.entrypoints.openai.errors import status_response
from inferengine.entrypoints.openai.streaming import SSE_DONE, SSEResponse, unless_disconnected
from inferengine.entrypoints.router.bodies import (
    CHAT_TOKENIZE_FIELDS,
    Broken,
    decode_body,
    error_event,
    max_new_tokens,
    prefill_body,
    sse_events,
    unsupported,
)
from inferengine.entrypoints.router.config import RouterServerConfig
from inferengine.entrypoints.router.metrics import RouterMetrics
from inferengine.entrypoints.router.upstreams import Engine, Upstreams
from inferengine.errors import excerpt
from inferengine.logger import init_logger

logger = init_logger(__name__)

_FAILED, _REFUSED, _NO_PARAMS = "failed", "refused", "no_kv_params"
_DONE = SSE_DONE.encode()


class Proxy:
    def __init__(
        self,
        config: RouterServerConfig,
        upstreams: Upstreams,
        policy: PDPolicy,
        metrics: RouterMetrics,
    ):
        self.config = config
        self.upstreams = upstreams
        self.policy = policy
        self.metrics = metrics

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self.upstreams.session is not None
        return self.upstreams.session

    async def handle(self, path: str, body: dict[str, Any], raw: Request) -> Response:
        """Serve one `/v1/completions` or `/v1/chat/completions` request."""
        rid = f"rtr-{uuid.uuid4().hex}"
        auth = self.upstreams.auth_headers(raw.headers.get("authorization"))
        headers = {**auth, "X-Request-Id": rid}
        return await unless_disconnected(raw, self._serve(rid, path, body, headers))

    async def _serve(
        self, rid: str, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Response:
        chat = path.endswith("/chat/completions")
        body.pop("kv_transfer_params", None)  # the router's to set, not the client's
        params, ids = None, None
        why = unsupported(body, chat)
        if why is not None:
            self.metrics.fallbacks.labels("unsupported").inc()
            logger.debug("%s goes whole to a decode engine: %s", rid, why)
        else:
            ids = await self._prompt_ids(body, chat, headers)
            params = await self._prefill(rid, path, body, chat, ids, headers)
        num_tokens = (len(ids) if ids else 0) + max_new_tokens(body)
        if body.get("stream"):
            return await self._open_stream(rid, path, body, params, num_tokens, headers)
        return await self._complete(rid, path, body, params, num_tokens, headers)

    async def _prompt_ids(
        self, body: dict[str, Any], chat: bool, headers: dict[str, str]
    ) -> list[int] | None:
        """The prompt's token ids, when they can change the prefill engine picked."""
        if not self.policy.wants_prompt_ids():
            return None
        if chat:
            request = {k: body[k] for k in CHAT_TOKENIZE_FIELDS if k in body}
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None
            request = {"prompt": prompt, "model": body.get("model")}
            if "add_special_tokens" in body:
                request["add_special_tokens"] = body["add_special_tokens"]
        return await self.upstreams.tokenize(request, headers.get("Authorization"))

    # ---- prefill -------------------------------------------------------------------------

    async def _prefill(
        self,
        rid: str,
        path: str,
        body: dict[str, Any],
        chat: bool,
        ids: list[int] | None,
        headers: dict[str, str],
    ) -> dict[str, Any] | None:
        """The prefill engine's `kv_transfer_params`, or None to decode without them."""
        payload = prefill_body(body, chat)
        salt, session = body.get("cache_salt"), body.get("prompt_cache_key")
        salt = salt if isinstance(salt, str) else None
        session = session if isinstance(session, str) else None
        tried: set[int] = set()
        outcome: Any = _FAILED
        while outcome == _FAILED:
            decision = self.policy.pick_prefill(rid, ids, salt, session, exclude=tried)
            if decision is None:
                break
            engine = self.upstreams.prefill[decision.replica_id]
            if tried:
                self.metrics.retries.labels("prefill").inc()
            tried.add(engine.index)
            self.metrics.prefill_decisions.labels(decision.reason).inc()
            self.metrics.requests.labels(engine.role, engine.url).inc()
            try:
                outcome = await self._try_prefill(engine, path, payload, headers)
            finally:
                self.policy.finish_prefill(rid, served=outcome != _FAILED)
            if isinstance(outcome, dict):
                self.metrics.transfers.inc()
                return outcome
        reason = {_FAILED: "prefill_failed", _REFUSED: "prefill_refused"}.get(outcome, outcome)
        self.metrics.fallbacks.labels(reason).inc()
        logger.warning("%s: decoded without transferred KV (%s)", rid, reason)
        return None

    async def _try_prefill(
        self, engine: Engine, path: str, payload: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any] | str:
        timeout = aiohttp.ClientTimeout(
            total=self.config.prefill_timeout, sock_connect=self.config.connect_timeout
        )
        try:
            async with self.session.post(
                engine.url + path, json=payload, headers=headers, timeout=timeout
            ) as resp:
                status, data = resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError) as e:
            self._failed(engine, e)
            return _FAILED
        if status == 429 or status >= 500:
            self._failed(engine, f"HTTP {status}: {excerpt(data.decode(errors='replace'))}")
            return _FAILED
        if status != 200:
            logger.debug("prefill engine %s refused (%d): %s", engine.url, status, data[:200])
            return _REFUSED
        try:
            params = json.loads(data).get("kv_transfer_params")
        except (ValueError, AttributeError) as e:
            self._failed(engine, e)
            return _FAILED
        if not isinstance(params, dict) or params.get("do_remote_prefill") is False:
            return _NO_PARAMS  # null, or the producer says it could not publish the pages
        return params

    def _failed(self, engine: Engine, error: object) -> None:
        self.metrics.failures.labels(engine.role, engine.url).inc()
        if isinstance(error, aiohttp.ClientConnectorError):
            self.upstreams.mark_down(engine, str(error))
        else:
            logger.warning("%s engine %s failed: %s", engine.role, engine.url, excerpt(repr(error)))

    # ---- decode --------------------------------------------------------------------------

    def _decode_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(
            sock_connect=self.config.connect_timeout, sock_read=self.config.request_timeout
        )

    def _next_decode(self, rid: str, num_tokens: int, tried: set[int]) -> Engine | None:
        engine_id = self.policy.pick_decode(rid, num_tokens, exclude=tried)
        if engine_id is None:
            return None
        if tried:
            self.metrics.retries.labels("decode").inc()
        tried.add(engine_id)
        engine = self.upstreams.decode[engine_id]
        self.metrics.requests.labels(engine.role, engine.url).inc()
        return engine

    def _drop_handle(self, rid: str, params: dict[str, Any] | None) -> None:
        """A decode engine that failed may have taken the pages: the next computes the prompt."""
        if params is not None:
            self.metrics.fallbacks.labels("decode_retried").inc()
            logger.warning("%s: decode engine failed; the next one computes the prompt", rid)

    def _gave_up(self, last: Response | None) -> Response:
        if last is not None:
            self.metrics.errors.labels("decode_failed").inc()
            return last
        self.metrics.errors.labels("no_decode_engine").inc()
        return status_response(503, "No decode engine is up; retry shortly.")

    async def _complete(
        self,
        rid: str,
        path: str,
        body: dict[str, Any],
        params: dict[str, Any] | None,
        num_tokens: int,
        headers: dict[str, str],
    ) -> Response:
        tried: set[int] = set()
        last: Response | None = None
        while (engine := self._next_decode(rid, num_tokens, tried)) is not None:
            served = False
            try:
                async with self.session.post(
                    engine.url + path,
                    json=decode_body(body, params),
                    headers=headers,
                    timeout=self._decode_timeout(),
                ) as resp:
                    status, data, ctype = resp.status, await resp.read(), resp.content_type
                served = status < 500
            except aiohttp.ClientConnectorError as e:
                self._failed(engine, e)  # never reached the engine: the handle still holds
                continue
            except (TimeoutError, aiohttp.ClientError) as e:
                self._failed(engine, e)
                self._drop_handle(rid, params)
                params = None
                continue
            finally:
                self.policy.finish_decode(rid, served)
            if status == 429 or status >= 500:
                self._failed(engine, f"HTTP {status}")
                last = Response(data, status_code=status, media_type=ctype)
                if status != 503:  # 503: refused at the door, the handle still holds
                    self._drop_handle(rid, params)
                    params = None
                continue
            return Response(data, status_code=status, media_type=ctype)
        return self._gave_up(last)

    async def _open_stream(
        self,
        rid: str,
        path: str,
        body: dict[str, Any],
        params: dict[str, Any] | None,
        num_tokens: int,
        headers: dict[str, str],
    ) -> Response:
        """A decode engine's stream, once its first event has come (failures before that are
        retried on another engine)."""
        tried: set[int] = set()
        last: Response | None = None
        while (engine := self._next_decode(rid, num_tokens, tried)) is not None:
            resp: aiohttp.ClientResponse | None = None
            try:
                resp = await self.session.post(
                    engine.url + path,
                    json=decode_body(body, params),
                    headers=headers,
                    timeout=self._decode_timeout(),
                )
                if resp.status != 200:
                    status, data, ctype = resp.status, await resp.read(), resp.content_type
                    resp.release()
                    self.policy.finish_decode(rid, served=status < 500)
                    if status != 429 and status < 500:
                        return Response(data, status_code=status, media_type=ctype)
                    self._failed(engine, f"HTTP {status}")
                    last = Response(data, status_code=status, media_type=ctype)
                    if status != 503:
                        self._drop_handle(rid, params)
                        params = None
                    continue
                events = sse_events(resp)
                first = await anext(events)
                if first.startswith(b'data: {"error"') and params is not None:
                    raise Broken(f"its first event is an error: {excerpt(first.decode())}")
            except aiohttp.ClientConnectorError as e:
                self.policy.finish_decode(rid, served=False)
                self._failed(engine, e)
                continue
            except (TimeoutError, aiohttp.ClientError, Broken, StopAsyncIteration) as e:
                self.policy.finish_decode(rid, served=False)
                if resp is not None:
                    resp.close()
                self._failed(engine, e)
                self._drop_handle(rid, params)
                params = None
                continue
            except BaseException:  # the client left (cancelled) or a bug: free the engine
                self.policy.finish_decode(rid, served=False)
                if resp is not None:
                    resp.close()
                raise
            return SSEResponse(self._relay(rid, engine, resp, first, events))
        return self._gave_up(last)

    async def _relay(
        self,
        rid: str,
        engine: Engine,
        resp: aiohttp.ClientResponse,
        first: bytes,
        events: AsyncGenerator[bytes, None],
    ) -> AsyncGenerator[bytes, None]:
        ended = False
        try:
            yield first
            last = first
            async for event in events:
                yield event
                last = event
            ended = last == _DONE
            if not ended:
                raise Broken("the stream ended without [DONE]")
        except (TimeoutError, aiohttp.ClientError, Broken) as e:
            self._failed(engine, e)
            self.metrics.errors.labels("stream_broken").inc()
            yield error_event(f"the decode engine's stream broke off: {excerpt(repr(e))}")
            yield _DONE
        finally:
            await events.aclose()
            if ended:
                resp.release()
            else:
                resp.close()  # the engine sees its client leave and aborts the request
            self.policy.finish_decode(rid, served=ended)
