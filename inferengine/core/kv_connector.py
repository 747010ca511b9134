"""`KVConnectorScheduler`: the scheduler's half of disaggregated prefill/decode (`kv_transfer/`).

A producer publishes the full pages of a `do_remote_decode` request's prompt in the step that
completes the prompt, and when the request ends holds them for a consumer (until the worker says
the consumer took them, or `kv_hold_timeout_s`). A consumer gives a `do_remote_prefill` request
pages for the producer's pages of its prompt (all but the last page, which it computes itself:
at least one token must produce logits), parks it `WAITING_FOR_REMOTE_KV`, lists the fetch in
the next `SchedulerOutput`, and when the worker reports the fetch sends it back to the waiting
queue with those tokens computed, or with none on a failure (the prompt is recomputed).

Pure Python: it decides; `worker/kv_connector.py` moves the bytes. Without a
`kv_transfer_config` every call is a no-op, so the scheduler calls it unconditionally.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from inferengine.config import KVTransferConfig
from inferengine.core.block_pool import KVCacheBlock
from inferengine.core.engine_io import KVTransferStats
from inferengine.core.kv_cache_manager import KVCacheManager
from inferengine.core.request import Request, RequestStatus
from inferengine.core.sched_output import KVFetch, KVTransferEvents
from inferengine.logger import init_logger

logger = init_logger(__name__)

RECENT = 32  # finished fetches kept in the stats for the histograms
EXPIRY_MARGIN_S = 1.0  # a consumer gives up this long before the producer frees the pages


@dataclass
class _Hold:
    blocks: list[KVCacheBlock]
    deadline: float  # on `clock`
    num_tokens: int


@dataclass
class _Load:
    request: Request
    num_blocks: int  # pages being fetched after the local prefix hits


class KVConnectorScheduler:
    def __init__(
        self,
        config: KVTransferConfig | None,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.clock = clock
        self.wall_clock = wall_clock
        self.fetches: list[KVFetch] = []  # for the next SchedulerOutput
        self.publishes: dict[str, list[int]] = {}
        self.published: dict[str, dict | None] = {}  # request -> transport params, till it ends
        self.released_early: set[str] = set()  # released before the request ended (pushed)
        self.pushed_tokens: dict[str, int] = {}  # published, until released
        self.holds: dict[str, _Hold] = {}
        self.loading: dict[str, _Load] = {}
        self.stats = KVTransferStats()
        self._seq = 0

    # ---- producer ------------------------------------------------------------------------

    def _publishes(self, request: Request) -> bool:
        params = request.kv_transfer_params
        if not params or self.config is None or not self.config.is_producer:
            return False
        return bool(params.get("do_remote_decode"))

    def _step_scheduled(self, request: Request, num_new: int) -> None:
        """`request` computes `num_new` more tokens this step: publish its prompt's full pages
        in the step that completes the prompt (once)."""
        if not self._publishes(request) or request.request_id in self.published:
            return
        if request.num_computed_tokens + num_new < request.num_prompt_tokens:
            return
        num_full = request.num_prompt_tokens // self.block_size
        self.published[request.request_id] = None  # until the worker's params come back
        if num_full:
            block_ids = self.kv.get_block_ids(request.request_id)[:num_full]
            self.publishes[request.request_id] = block_ids
            self.pushed_tokens[request.request_id] = num_full * self.block_size
        else:
            self.published[request.request_id] = {}  # nothing to publish or hold

    def request_finished(self, request: Request) -> dict | None:
        """The `kv_transfer_params` of a producer's request that ends now (before its pages
        are freed): the pages are held for a consumer unless already pushed."""
        if not self._publishes(request):
            return None
        req_id = request.request_id
        transport = self.published.pop(req_id, None)
        if request.status == RequestStatus.FINISHED_ABORTED:
            self.released_early.discard(req_id)
            return None
        if transport is None:
            return {"do_remote_prefill": False, "error": "the prompt's KV was not published"}
        num_full = request.num_prompt_tokens // self.block_size
        blocks = self.kv.req_to_blocks.get(req_id, [])[:num_full]
        self.pushed_tokens.pop(req_id, None)
        if num_full and req_id not in self.released_early:
            self.kv.pool.touch(blocks)
            deadline = self.clock() + self.config.kv_hold_timeout_s
            self.holds[req_id] = _Hold(blocks, deadline, num_full * self.block_size)
        self.released_early.discard(req_id)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": req_id,
            "remote_block_ids": [b.block_id for b in blocks],
            "remote_host": self.config.kv_ip,
            "remote_port": self.config.kv_port,
            "num_tokens": num_full * self.block_size,
            "block_size": self.block_size,
            "expires_at": self.wall_clock() + self.config.kv_hold_timeout_s,
            **transport,
        }

    def _release(self, req_id: str) -> None:
        hold = self.holds.pop(req_id, None)
        if hold is None:
            num_tokens = self.pushed_tokens.pop(req_id, 0)
            if req_id in self.published:  # pushed before the request ended
                self.released_early.add(req_id)
                self.stats.sent_tokens += num_tokens
                self.stats.sent_transfers += 1
            return
        self.kv.pool.free_blocks(reversed(hold.blocks))
        self.stats.sent_tokens += hold.num_tokens
        self.stats.sent_transfers += 1

    def expire_holds(self) -> None:
        """Free the pages of transfers no consumer took in time."""
        if not self.holds:
            return
        now = self.clock()
        for req_id, hold in list(self.holds.items()):
            if hold.deadline <= now:
                del self.holds[req_id]
                self.kv.pool.free_blocks(reversed(hold.blocks))
                self.stats.expired_holds += 1
                logger.warning(
                    "KV transfer: no consumer took the %d pages of %s within %.0f s; freed",
                    len(hold.blocks),
                    req_id,
                    self.config.kv_hold_timeout_s if self.config else 0,
                )

    # ---- consumer ------------------------------------------------------------------------

    def wants_fetch(self, request: Request) -> bool:
        params = request.kv_transfer_params
        if not params or self.config is None or not self.config.is_consumer:
            return False
        return bool(params.get("do_remote_prefill")) and not request.kv_fetch_done

    def start_fetch(self, request: Request, hits: list[KVCacheBlock]) -> bool | None:
        """Park `request` for the producer's pages after its local prefix hits `hits`: True
        when parked, False when it runs as a plain request (nothing to fetch, or the params
        are unusable: counted as a fallback), None when no pages are free yet."""
        params = request.kv_transfer_params or {}
        remote_ids = params.get("remote_block_ids")
        problem = _check_params(params, self.block_size, self.wall_clock())
        if problem is not None:
            request.kv_fetch_done = True
            self.stats.fallbacks += 1
            logger.warning(
                "KV transfer for %s: %s; computing the prompt", request.request_id, problem
            )
            return False
        assert isinstance(remote_ids, list) and self.config is not None
        want = (request.num_prompt_tokens - 1) // self.block_size  # the last page is computed
        end = min(want, len(remote_ids))
        num_blocks = max(0, end - len(hits))
        if not remote_ids:
            request.kv_fetch_done = True
            return False
        num_hit_tokens = len(hits) * self.block_size
        new_blocks = self.kv.allocate_slots(
            request, num_blocks * self.block_size, hits, num_hit_tokens, cache_new=False
        )
        if new_blocks is None:
            return None
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_computed_tokens = num_hit_tokens
        self.loading[request.request_id] = _Load(request, num_blocks)
        self.fetches.append(
            KVFetch(
                req_id=request.request_id,
                params=params,
                remote_block_ids=list(remote_ids[len(hits) : len(hits) + num_blocks]),
                block_ids=[b.block_id for b in new_blocks],
            )
        )
        return True

    def fetch_finished(self, req_id: str, ok: bool, seconds: float, nbytes: int) -> Request | None:
        """Fold in a fetch's outcome; the request, to go back to the waiting queue (or to be
        freed, if it was aborted meanwhile)."""
        load = self.loading.pop(req_id, None)
        if load is None:
            return None
        request = load.request
        request.kv_fetch_done = True
        if request.is_finished:
            return request
        if ok:
            request.num_computed_tokens += load.num_blocks * self.block_size
            self.stats.received_tokens += load.num_blocks * self.block_size
            self.stats.received_transfers += 1
            self._seq += 1
            self.stats.recent = [*self.stats.recent[-(RECENT - 1) :], (self._seq, seconds, nbytes)]
        else:
            self.stats.fallbacks += 1
            logger.warning(
                "KV transfer for %s failed or timed out after %.2f s; computing the prompt",
                req_id,
                seconds,
            )
            self.kv.free(request)  # the local hits keep their hashes, the fresh pages had none
            request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        return request

    def admitted(self, request: Request) -> None:
        """A request's first admission: count the prompt tokens a consumer computes itself."""
        if request.kv_fetch_done:
            self.stats.local_prefill_tokens += (
                request.num_prompt_tokens - request.num_computed_tokens
            )

    # ---- the step ------------------------------------------------------------------------

    def step_work(
        self, num_scheduled: dict[str, int], requests: dict[str, Request]
    ) -> tuple[list[KVFetch], dict[str, list[int]]]:
        """This step's fetches to start and pages to publish (`num_scheduled`: the step's
        tokens per request, before they count as computed)."""
        if self.config is None:
            return [], {}
        for req_id, num_new in num_scheduled.items():
            self._step_scheduled(requests[req_id], num_new)
        work = (self.fetches, self.publishes)
        self.fetches, self.publishes = [], {}
        return work

    def update(self, events: KVTransferEvents | None) -> list[Request]:
        """Fold in the worker's events; the requests whose fetch ended."""
        if not events:
            return []
        for req_id, transport in events.published.items():
            if req_id in self.published:
                self.published[req_id] = transport
        for req_id in events.released:
            self._release(req_id)
        done = []
        for req_id, (ok, seconds, nbytes) in events.fetched.items():
            request = self.fetch_finished(req_id, ok, seconds, nbytes)
            if request is not None:
                done.append(request)
        return done

    def make_stats(self) -> KVTransferStats | None:
        if self.config is None:
            return None
        self.stats.held_blocks = sum(len(h.blocks) for h in self.holds.values())
        self.stats.waiting_requests = len(self.loading)
        return self.stats


def _check_params(params: dict, block_size: int, now: float) -> str | None:
    """Why a consumer cannot use a producer's `kv_transfer_params`, or None."""
    remote_ids = params.get("remote_block_ids")
    if not isinstance(remote_ids, list) or not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in remote_ids
    ):
        return "kv_transfer_params.remote_block_ids is not a list of page ids"
    if not isinstance(params.get("remote_request_id"), str):
        return "kv_transfer_params.remote_request_id is missing"
    if params.get("block_size", block_size) != block_size:
        return f"the producer's pages hold {params.get('block_size')} tokens, these {block_size}"
    expires_at = params.get("expires_at")
    if isinstance(expires_at, int | float) and expires_at - EXPIRY_MARGIN_S <= now:
        return "the producer's hold on the pages has expired"
    return None
