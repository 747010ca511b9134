"""The router's engines: one HTTP session to them, their health and prefill KV events, polled.

Every `--health-check-interval` seconds each engine's `/health` is asked; an engine that does not
answer 200 is down (no request goes there) until it does again. A prefill engine that is up is
also asked for its KV events since the last poll (`GET /kv_events`, `core/kv_event_log.py`),
which `PDPolicy` replays into its prefix index; a new engine incarnation or a reader that fell
behind gets a snapshot. An engine without `/kv_events` is routed to by load alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import aiohttp

from inferengine.dp.pd_policy import PDPolicy, parse_kv_events
from inferengine.entrypoints.router.config import RouterServerConfig
from inferengine.logger import init_logger

logger = init_logger(__name__)

PREFILL, DECODE = "prefill", "decode"
_POLL_TIMEOUT_S = 5.0  # for one /health or /kv_events poll
_TOKENIZE_TIMEOUT_S = 10.0


@dataclass
class Engine:
    role: str  # PREFILL or DECODE
    index: int  # in its role's list (the policy's engine id)
    url: str
    up: bool = False  # as of the last poll or request
    events_epoch: str | None = None  # the KV-event log read so far (prefill engines)
    events_next: int = 0
    has_events: bool = True  # False once the engine said it serves no /kv_events


class Upstreams:
    """The engines of both roles, an aiohttp session to them, and the poller task."""

    def __init__(self, config: RouterServerConfig, policy: PDPolicy):
        self.config = config
        self.policy = policy
        self.prefill = [Engine(PREFILL, i, u) for i, u in enumerate(config.prefill)]
        self.decode = [Engine(DECODE, i, u) for i, u in enumerate(config.decode)]
        for engine in self.all:
            self._set(engine, False)
        self.session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None

    @property
    def all(self) -> list[Engine]:
        return [*self.prefill, *self.decode]

    def auth_headers(self, client_auth: str | None) -> dict[str, str]:
        if self.config.api_key:
            return {"Authorization": f"Bearer {self.config.api_key}"}
        return {"Authorization": client_auth} if client_auth else {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0)  # the engines bound their own queues
        self.session = aiohttp.ClientSession(connector=connector)
        await self.poll_all()  # know who is up before the first request
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self.session is not None:
            await self.session.close()

    # ---- state ---------------------------------------------------------------------------

    def mark_down(self, engine: Engine, why: str) -> None:
        if engine.up:
            logger.warning("%s engine %s is down: %s", engine.role, engine.url, why)
        self._set(engine, False)

    def _set(self, engine: Engine, up: bool) -> None:
        if up and not engine.up and engine.role == PREFILL:
            engine.events_epoch = None  # its index restarts empty: read a snapshot
            engine.has_events = True  # perhaps another version of the engine: ask again
        engine.up = up
        if engine.role == PREFILL:
            self.policy.set_prefill_up(engine.index, up)
        else:
            self.policy.set_decode_up(engine.index, up)

    # ---- polling -------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval)
            try:
                await self.poll_all()
            except Exception:  # a poll must never stop the poller
                logger.exception("router: polling the engines failed")

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(e) for e in self.all))

    async def _poll(self, engine: Engine) -> None:
        healthy = await self._healthy(engine)
        if healthy and not engine.up:
            logger.info("%s engine %s is up", engine.role, engine.url)
        if not healthy:
            self.mark_down(engine, "its /health does not answer 200")
            return
        self._set(engine, True)
        if engine.role == PREFILL and engine.has_events:
            await self._read_events(engine)

    async def _healthy(self, engine: Engine) -> bool:
        assert self.session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=_POLL_TIMEOUT_S)
            async with self.session.get(f"{engine.url}/health", timeout=timeout) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def _read_events(self, engine: Engine) -> None:
        assert self.session is not None
        params: dict[str, Any] = {"since": engine.events_next}
        if engine.events_epoch is not None:
            params["epoch"] = engine.events_epoch
        try:
            async with self.session.get(
                f"{engine.url}/kv_events",
                params=params,
                headers=self.auth_headers(None),
                timeout=aiohttp.ClientTimeout(total=_POLL_TIMEOUT_S),
            ) as resp:
                if resp.status in (401, 404, 501):
                    engine.has_events = False
                    logger.warning(
                        "prefill engine %s serves no KV events (HTTP %d%s): it is picked by "
                        "load only",
                        engine.url,
                        resp.status,
                        "; give the router its --api-key" if resp.status == 401 else "",
                    )
                    return
                if resp.status != 200:
                    return  # starting, draining, or the key is wrong: try again next time
                answer = await resp.json()
        except (TimeoutError, aiohttp.ClientError, ValueError) as e:
            logger.debug("router: KV events of %s: %s", engine.url, e)
            return
        self.apply_events(engine, answer)

    def apply_events(self, engine: Engine, answer: dict[str, Any]) -> None:
        """One `/kv_events` answer replayed into the policy's index of `engine`."""
        self.policy.set_block_size(int(answer["block_size"]))
        self.policy.apply_kv_events(engine.index, parse_kv_events(answer["events"]))
        engine.events_epoch = answer["epoch"]
        engine.events_next = int(answer["next_seq"])

    # ---- tokenizing ----------------------------------------------------------------------

    async def tokenize(self, body: dict[str, Any], client_auth: str | None) -> list[int] | None:
        """A prompt's token ids from a prefill engine's `/tokenize` (None if it cannot say)."""
        assert self.session is not None
        engine = next((e for e in self.prefill if e.up), None)
        if engine is None:
            return None
        try:
            async with self.session.post(
                f"{engine.url}/tokenize",
                json=body,
                headers=self.auth_headers(client_auth),
                timeout=aiohttp.ClientTimeout(total=_TOKENIZE_TIMEOUT_S),
            ) as resp:
                if resp.status != 200:
                    return None
                tokens = (await resp.json()).get("tokens")
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        return tokens if isinstance(tokens, list) else None
