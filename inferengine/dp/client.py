"""`DPClient`: the engine-core client protocol (`AsyncMPClient`'s) over data-parallel replicas.

Every request is routed by the `Router` (its prompt's block hashes, its session, the replicas'
load), sent to that replica and followed until it finishes. One reader task per replica takes
its frames: KV events feed the router's prefix index, stats its load, outputs go to the one
queue `AsyncLLM` reads. When a replica's stream breaks, the replica is down: its requests that
have produced nothing yet go to other replicas, those already streaming fail with
`EngineDeadError`, and a recovery task waits for Ray's new incarnation (forcing one if the old
process is still there) and routes to it again. The client is dead only when every replica is.

Replicas are reached through `ReplicaHandle`s (`ray_backend.RayReplicaHandle` in the server;
tests give in-process fakes).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from inferengine import envs
from inferengine.config import EngineConfig
from inferengine.core.engine_io import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from inferengine.core.hashing import BlockHash, hash_prompt_blocks
from inferengine.dp.replica import ReplicaFrame, decode_frame, encode_requests
from inferengine.dp.router import Router, RouterConfig
from inferengine.dp.stats import hit_rate, retire, sum_stats
from inferengine.errors import EngineDeadError
from inferengine.logger import init_logger

logger = init_logger(__name__)

READY_RETRIES = 3  # failed readiness checks in a row before a restarting replica counts as dead


class ReplicaHandle(Protocol):
    """One replica as the client sees it (calls return at once; their results are awaitable)."""

    replica_id: int

    async def ready(self, timeout: float) -> dict[str, Any]: ...

    def add_requests(self, payload: bytes) -> Awaitable[Any]: ...

    def abort_requests(self, request_ids: list[str]) -> Awaitable[Any]: ...

    async def utility(self, method: str, args: list, timeout: float) -> Any: ...

    def outputs(self) -> AsyncIterator[list[bytes]]: ...

    def restart(self) -> None: ...

    def shutdown(self) -> None: ...


FailRequests = Callable[[list[str], BaseException], None]


class ReplicaUnavailable(Exception):
    """A replica is (re)starting: ask again later (not a sign that it is gone for good)."""


@dataclass
class ReplicaSlot:
    handle: ReplicaHandle
    status: str = "starting"  # starting -> up -> restarting -> up ...; or dead
    info: dict[str, Any] = field(default_factory=dict)
    stats: SchedulerStats | None = None
    served: int = 0  # requests finished by this replica (every incarnation)
    restarts: int = 0
    reader: asyncio.Task | None = None


@dataclass(slots=True, eq=False)
class _Tracked:
    request: EngineCoreRequest
    hashes: list[BlockHash]
    replica: int = -1
    started: bool = False  # the replica sent an output for it


class DPClient:
    def __init__(
        self,
        config: EngineConfig,
        handles: list[ReplicaHandle],
        router_config: RouterConfig | None = None,
    ):
        self.config = config
        self.block_size = config.cache_config.block_size
        self.caching = config.cache_config.enable_prefix_caching
        self.slots = [ReplicaSlot(h) for h in handles]
        self.router = Router(len(handles), router_config or RouterConfig.from_engine_config(config))
        self.requests: dict[str, _Tracked] = {}
        self.parked: list[_Tracked] = []  # waiting for a replica to come back
        self.ready_info: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self.on_failed: FailRequests | None = None  # `DataParallelLLM` fails them in place
        self.failed_streams = 0
        self._retired: dict[str, Any] = {}
        self._outputs: asyncio.Queue[EngineCoreOutputs | BaseException] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    # ---- start-up ---------------------------------------------------------------------

    async def wait_until_ready(self) -> dict[str, Any]:
        timeout = envs.engine_startup_timeout_s()
        results = await asyncio.gather(
            *(s.handle.ready(timeout) for s in self.slots), return_exceptions=True
        )
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            i, error = failed[0]
            self.dead_reason = f"replica {i} failed to start: {type(error).__name__}: {error}"
            self.shutdown()
            raise EngineDeadError(f"the engine failed to start: {self.dead_reason}")
        for slot, info in zip(self.slots, results, strict=True):
            assert isinstance(info, dict)
            self._serve(slot, info)
        first = self.slots[0].info
        self.ready_info = {
            **{k: first.get(k) for k in ("attention_backend", "attention_backend_timings_ms")},
            # one null page, as one engine's count has
            "num_blocks": 1 + sum(int(s.info.get("num_blocks", 1)) - 1 for s in self.slots),
            "max_model_len": min(int(s.info["max_model_len"]) for s in self.slots),
            "pid": first.get("pid"),
            "data_parallel_size": len(self.slots),
        }
        return self.ready_info

    def _serve(self, slot: ReplicaSlot, info: dict[str, Any]) -> None:
        r = slot.handle.replica_id
        slot.info, slot.status = info, "up"
        self.router.mark_up(r)
        slot.reader = asyncio.create_task(self._read(r))
        logger.info("replica %d serves (pid %s on %s)", r, info.get("pid"), info.get("node"))

    # ---- sending ----------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine replicas are not running ({self.dead_reason}).")

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        tracked = _Tracked(request, self._hashes(request))
        self.requests[request.request_id] = tracked
        self._dispatch(tracked)

    def _hashes(self, request: EngineCoreRequest) -> list[BlockHash]:
        """The prompt's blocks a replica's prefix cache could serve (as `KVCacheManager`)."""
        if not self.caching or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (len(request.prompt_token_ids) - 1) // self.block_size
        return hash_prompt_blocks(
            request.prompt_token_ids, self.block_size, request.cache_salt, max_blocks
        )

    def _dispatch(self, tracked: _Tracked, rerouted: bool = False) -> None:
        request = tracked.request
        if self.router.num_up == 0:
            tracked.replica = -1  # a replica's late outputs for it are stale
            self.parked.append(tracked)  # sent when a replica is back (or failed if none is)
            return
        decision = self.router.route(
            request.request_id,
            tracked.hashes,
            len(request.prompt_token_ids),
            request.cache_key,
            rerouted,
        )
        tracked.replica = decision.replica_id
        handle = self.slots[decision.replica_id].handle
        self._settle(handle.add_requests(encode_requests([request])))

    def _settle(self, call: Awaitable[Any]) -> None:
        """Let a call run in the background; its failure shows as the replica's (the reader's
        stream breaks too), so it is only logged."""
        asyncio.ensure_future(call).add_done_callback(_log_failure)

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            tracked = self.requests.pop(request_id, None)
            if tracked is None:
                continue
            if tracked in self.parked:
                self.parked.remove(tracked)
                continue
            self.router.finish(request_id, served=False)
            by_replica[tracked.replica].append(request_id)
        for r, ids in by_replica.items():
            if self.slots[r].status == "up":
                self._settle(self.slots[r].handle.abort_requests(ids))

    async def call_utility(self, method: str, *args: Any, timeout: float = 10.0) -> Any:
        """A utility on every replica that is up, the answers combined as one engine's."""
        self._check_alive()
        up = [s for s in self.slots if s.status == "up"]
        results = await asyncio.gather(
            *(s.handle.utility(method, list(args), timeout) for s in up), return_exceptions=True
        )
        answers = [(s, r) for s, r in zip(up, results, strict=True) if not isinstance(r, Exception)]
        if not answers and results:
            raise RuntimeError(f"no replica answered {method!r}: {results[0]}")
        if method == "get_stats":
            for slot, raw in answers:
                s = slot.stats = msgspec.convert(raw, SchedulerStats)
                r = slot.handle.replica_id
                self.router.update_load(r, s.num_running, s.num_waiting, s.kv_cache_usage)
            return msgspec.to_builtins(self.scheduler_stats())
        values = [r for _, r in answers]
        if method == "reset_prefix_cache":
            return all(values)
        if method == "device_memory":
            used = [v for v in values if v is not None]
            return sum(used) if used else None
        if method == "expert_token_counts":
            return _sum_counts(values)
        if method == "activity":  # every replica's sessions, each named with its replica
            return {
                "sessions": [
                    {**session, "replica": slot.handle.replica_id}
                    for slot, answer in answers
                    for session in answer["sessions"]
                ],
                "num_structured_output_requests": sum(
                    v["num_structured_output_requests"] for v in values
                ),
            }
        return values[0] if values else None

    # ---- receiving --------------------------------------------------------------------

    async def get_output(self) -> EngineCoreOutputs:
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)  # every later caller sees it too
            raise item
        return item

    async def _read(self, r: int) -> None:
        slot = self.slots[r]
        try:
            async for frames in slot.handle.outputs():
                for frame in frames:
                    self._take_frame(r, decode_frame(frame))
            reason = "its output stream ended"
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        if not self._closing:
            self._replica_failed(r, reason)

    def _take_frame(self, r: int, frame: ReplicaFrame) -> None:
        slot = self.slots[r]
        self.router.apply_kv_events(r, frame.kv_events)
        outputs = frame.outputs
        if outputs.scheduler_stats is not None:
            s = slot.stats = outputs.scheduler_stats
            self.router.update_load(r, s.num_running, s.num_waiting, s.kv_cache_usage)
        kept, stale = [], []
        for out in outputs.outputs:
            tracked = self.requests.get(out.request_id)
            if tracked is None or tracked.replica != r:
                if tracked is not None:
                    stale.append(out.request_id)  # sent elsewhere since: stop it here
                continue
            tracked.started = True
            if out.finish_reason is not None:
                del self.requests[out.request_id]
                self.router.finish(out.request_id)
                slot.served += 1
            kept.append(out)
        if stale:
            self._settle(slot.handle.abort_requests(stale))
        if kept:
            ids = {out.request_id for out in kept}
            errors = {k: v for k, v in outputs.errors.items() if k in ids}
            stats = self.scheduler_stats() if outputs.scheduler_stats is not None else None
            self._outputs.put_nowait(
                EngineCoreOutputs(kept, stats, outputs.timestamp or time.time(), errors)
            )

    # ---- failures ---------------------------------------------------------------------

    def _replica_failed(self, r: int, reason: str) -> None:
        slot = self.slots[r]
        if slot.status != "up":
            return
        slot.status = "restarting"
        slot.restarts += 1
        self.router.mark_down(r)
        retire(self._retired, slot.stats)
        slot.stats = None
        orphans = [t for t in self.requests.values() if t.replica == r and t not in self.parked]
        streaming = [t.request.request_id for t in orphans if t.started]
        logger.error(
            "replica %d stopped (%s): %d request(s) go to other replicas, %d streaming fail",
            r,
            reason,
            len(orphans) - len(streaming),
            len(streaming),
        )
        for request_id in streaming:
            del self.requests[request_id]
            self.router.finish(request_id, served=False)
        if streaming:
            self.failed_streams += len(streaming)
            self._fail(
                streaming,
                EngineDeadError(
                    f"engine replica {r} stopped while this request was streaming ({reason}); "
                    "retry it."
                ),
            )
        for tracked in orphans:
            if not tracked.started:
                self.router.finish(tracked.request.request_id, served=False)
                self._dispatch(tracked, rerouted=True)
        task = asyncio.create_task(self._recover(r))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        if self.on_failed is not None:
            self.on_failed(request_ids, error)
            return
        from inferengine.core.engine_io import EngineCoreOutput
        from inferengine.core.request import FinishReason

        outs = [EngineCoreOutput(i, [], finish_reason=FinishReason.ABORT) for i in request_ids]
        errors = dict.fromkeys(request_ids, str(error))
        self._outputs.put_nowait(EngineCoreOutputs(outs, None, time.time(), errors))

    async def _recover(self, r: int) -> None:
        """Wait for the replica's next incarnation (Ray restarts a dead actor; one whose stream
        broke while its process lives is restarted here), then route to it again."""
        slot = self.slots[r]
        old = slot.info.get("incarnation")
        deadline = time.monotonic() + envs.engine_startup_timeout_s()
        failures = 0
        while not self._closing and failures < READY_RETRIES and time.monotonic() < deadline:
            try:
                info = await slot.handle.ready(max(1.0, deadline - time.monotonic()))
            except asyncio.CancelledError:
                raise
            except ReplicaUnavailable:
                await asyncio.sleep(0.5)
                continue
            except Exception as e:
                failures += 1
                logger.warning("replica %d is not back yet: %s: %s", r, type(e).__name__, e)
                if failures < READY_RETRIES:
                    await asyncio.sleep(1.0)
                continue
            if info.get("incarnation") == old:
                slot.handle.restart()
                await asyncio.sleep(0.2)
                continue
            self._serve(slot, info)
            parked, self.parked = self.parked, []
            for tracked in parked:
                self._dispatch(tracked, rerouted=True)
            return
        if self._closing:
            return
        slot.status = "dead"
        logger.error("replica %d did not come back; it serves no more", r)
        if all(s.status == "dead" for s in self.slots):
            self._mark_dead("every replica stopped")

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("the engine replicas are gone: %s", reason)
        self.parked.clear()
        self._outputs.put_nowait(EngineDeadError(f"the engine stopped: {reason}"))

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    # ---- stats ------------------------------------------------------------------------

    def scheduler_stats(self) -> SchedulerStats:
        live = [s.stats for s in self.slots if s.status == "up" and s.stats is not None]
        return sum_stats(live, self._retired)

    def replica_stats(self) -> list[dict[str, Any]]:
        streaming = [0] * len(self.slots)  # requests that have produced output there
        for tracked in self.requests.values():
            streaming[tracked.replica] += tracked.started and tracked.replica >= 0
        out = []
        for r, slot in enumerate(self.slots):
            s, view = slot.stats, self.router.replicas[r]
            out.append(
                {
                    "id": r,
                    "status": slot.status,
                    "pid": slot.info.get("pid"),
                    "node": slot.info.get("node"),
                    "requests_served": slot.served,
                    "requests_in_flight": view.in_flight,
                    "requests_streaming": streaming[r],
                    "num_requests_running": s.num_running if s else 0,
                    "num_requests_waiting": s.num_waiting if s else 0,
                    "kv_cache_usage": round(s.kv_cache_usage, 6) if s else 0.0,
                    "prefix_cache_queries": s.prefix_cache_queries if s else 0,
                    "prefix_cache_hits": s.prefix_cache_hits if s else 0,
                    "prefix_cache_hit_rate": hit_rate(s),
                    "cached_blocks_indexed": len(view.cached),
                    "cpu_cached_blocks_indexed": len(view.cpu_cached),
                    "restarts": slot.restarts,
                }
            )
        return out

    def router_stats(self) -> dict[str, Any]:
        return {
            "decisions": dict(self.router.decisions),
            "rerouted_requests": self.router.rerouted,
            "failed_streams": self.failed_streams,
        }

    # ---- shutdown ---------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        logger.info("stopping %d engine replica(s)", len(self.slots))
        for slot in self.slots:
            if slot.reader is not None:
                slot.reader.cancel()
        for task in list(self._tasks):
            task.cancel()
        for slot in self.slots:
            try:
                slot.handle.shutdown()
            except Exception as e:  # shutting down: nothing left to do about it
                logger.debug("replica %d did not shut down cleanly: %s", slot.handle.replica_id, e)
        if self.dead_reason is None:
            self.dead_reason = "shut down"


def _log_failure(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("a call to a replica failed: %s", task.exception())


def _sum_counts(values: list[Any]) -> dict[int, list[int]]:
    total: dict[int, list[int]] = {}
    for counts in values:
        for layer, per_expert in (counts or {}).items():
            old = total.get(int(layer), [0] * len(per_expert))
            total[int(layer)] = [a + b for a, b in zip(old, per_expert, strict=False)]
    return total
