"""`KVCacheManager`: which pages each request owns, prefix-cache lookups over the GPU pool and
the CPU tier, session leases, and page accounting.

With a CPU tier, the manager lists the copies each step needs: `offloads` (GPU page -> host
slot: a cached page this step reuses), `loads` (host slot -> a fresh GPU page: a prefix found
only in the CPU tier) and `writebacks` (GPU page -> host slot: a free page next in line for
eviction, saved ahead of time). The worker runs the offloads first, then the loads, then the
step, so a page is saved before it is overwritten and a slot is filled before it is read; the
write-backs overlap the step (their pages are free in it) and are done before the next.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inferengine.core.block_pool import BlockPool, KVCacheBlock, KVEvent
from inferengine.core.engine_io import KVTierStats
from inferengine.core.host_tier import HostTier
from inferengine.core.request import Request

Copies = list[tuple[int, int]]

# An agent's later turn can load ~500 pages at once, taking as many from the front of the free
# list: write-backs keep that much of it saved, so the load step rarely saves pages first.
WRITEBACK_WINDOW = 512  # free pages next in line for eviction looked at each step
WRITEBACK_PER_STEP = 128  # of which at most this many are copied to the CPU tier ahead of time


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache (either tier)
    host_hits: int = 0  # of which found in the CPU tier only (loaded, not recomputed)
    offloaded_blocks: int = 0
    loaded_blocks: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_host_blocks: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.clock = clock
        self.pool = BlockPool(num_blocks, enable_caching, clock)
        self.host = HostTier(num_host_blocks) if num_host_blocks and enable_caching else None
        self.pool.track_evictions = self.host is not None
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already hashed
        self.prefix_stats = PrefixCacheStats()
        self.offloads: list[tuple[int, int]] = []  # (GPU page, host slot), this step
        self.loads: list[tuple[int, int]] = []  # (host slot, GPU page), this step
        self.writebacks: list[tuple[int, int]] = []  # (GPU page, host slot), this step
        self.sessions: dict[str, float] = {}  # session key -> end of its longest lease
        self._session_ends: list[tuple[float, str]] = []  # heap of (lease end, session key)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def enable_kv_events(self) -> None:
        """Record, in one ordered list, every change to the hashes the GPU pool and the CPU tier
        hold (`block_pool.py` lists the events; a data-parallel replica's router replays them)."""
        self.pool.kv_events = []
        if self.host is not None:
            self.host.kv_events = self.pool.kv_events

    def take_kv_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first ([] when not recording)."""
        events = self.pool.kv_events
        if not events:
            return []
        taken = events.copy()
        events.clear()  # the one list both tiers append to stays in place
        return taken

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of leading full blocks already in the GPU pool, and their tokens.

        At least one token is always left to compute, so the request still produces logits.
        """
        if not self.enable_caching or _reads_every_prompt_token(request):
            return [], 0
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[: self._max_hit_blocks(request)]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_host_hits(self, request: Request, num_gpu_hits: int) -> list[int]:
        """Host slots continuing the GPU hits (`num_gpu_hits` blocks) from the CPU tier."""
        if self.host is None or _reads_every_prompt_token(request):
            return []
        slots = []
        for block_hash in request.block_hashes[num_gpu_hits : self._max_hit_blocks(request)]:
            slot = self.host.lookup(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def record_lookup(self, num_tokens: int, num_gpu_hits: int, num_host_hits: int) -> None:
        """Count a request's first admission: its prompt tokens and the pages found in each
        tier (a request looked up again, after a failed allocation or a preemption, is not
        counted twice)."""
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += (num_gpu_hits + num_host_hits) * self.block_size
        self.prefix_stats.host_hits += num_host_hits * self.block_size

    def _max_hit_blocks(self, request: Request) -> int:
        return (request.num_tokens - 1) // self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
        host_hits: Sequence[int] = (),
        cache_new: bool = True,
    ) -> list[KVCacheBlock] | None:
        """Give `request` pages for `num_new_tokens` more tokens, after its prefix-cache hits
        (`num_new_computed_tokens` counts those in the pool and the `host_hits` slots, which
        are loaded into the first new pages).

        Returns the newly allocated blocks, or None (changing nothing) when too few are free.
        Full blocks that this step will fill are registered in the prefix cache right away, so a
        request scheduled later in the same step can share them (their K/V are written before
        any attention reads them, layer by layer); with `cache_new` False they are registered
        by a later call (pages another engine's KV is still being copied into).
        """
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Hits sitting in the free list stop being free once touched.
        num_hits_in_free_list = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_hits_in_free_list:
            return None
        self.req_to_blocks[request.request_id] = blocks
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        self._save_evicted()
        for slot, block in zip(host_hits, new_blocks, strict=False):
            self.loads.append((slot, block.block_id))
        self.prefix_stats.loaded_blocks += len(host_hits)
        blocks.extend(new_blocks)
        if self.enable_caching and cache_new:
            num_known = min(num_computed + num_new_tokens, request.num_tokens)
            self._cache_full_blocks(request, blocks, num_known // self.block_size)
        return new_blocks

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_full: int
    ) -> None:
        start = self.num_cached_blocks.get(request.request_id, 0)
        num_full = min(num_full, len(request.block_hashes))
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Release the request's pages; the cached ones stay findable until evicted, after
        every unleased page if the request's session leased them.

        Blocks registered for tokens that were scheduled but never computed (the request was
        preempted in the step that scheduled them) lose their hash first.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        first_uncomputed = request.num_computed_tokens // self.block_size
        for block in blocks[first_uncomputed:]:
            if block.ref_cnt == 1:
                self.pool.uncache_block(block)
        self._lease(request, blocks[:first_uncomputed])
        self.pool.free_blocks(reversed(blocks))

    def _lease(self, request: Request, computed: list[KVCacheBlock]) -> None:
        if request.cache_ttl_s is None and not request.cache_breakpoints:
            return
        now = self.clock()
        ends = [0.0] * len(computed)
        if request.cache_ttl_s is not None:
            ends = [now + request.cache_ttl_s] * len(computed)
        for num_tokens, ttl_s in request.cache_breakpoints:
            for i in range(min(num_tokens // self.block_size, len(computed))):
                ends[i] = max(ends[i], now + ttl_s)
        for block, end in zip(computed, ends, strict=True):
            if end > block.lease_until and block.block_hash is not None:
                block.lease_until = end
                if self.host is not None and block.block_hash in self.host:
                    self.host.lease(block.block_hash, end)
        if request.cache_key is not None and ends:
            end = max(self.sessions.get(request.cache_key, 0.0), *ends)
            self.sessions[request.cache_key] = end
            heapq.heappush(self._session_ends, (end, request.cache_key))

    # ---- the CPU tier ------------------------------------------------------------------

    def _save_evicted(self) -> None:
        """Cached pages just taken for reuse go to the CPU tier first (unless already there)."""
        if self.host is None or not self.pool.evicted:  # the pool notes none without a tier
            return
        evicted, self.pool.evicted = self.pool.evicted, []
        for block_hash, block_id, lease_until in evicted:
            if block_hash in self.host:
                if lease_until > 0.0:
                    self.host.lease(block_hash, lease_until)
                continue
            slot = self.host.reserve(block_hash, lease_until)
            if slot is not None:
                self.offloads.append((block_id, slot))
                self.prefix_stats.offloaded_blocks += 1

    def end_step(self) -> tuple[Copies, Copies, Copies]:
        """This step's copies, (offloads, loads, writebacks): the write-backs save ahead of
        time the pages next in line for eviction into free slots (so that reusing them later
        needs no copy of its own; a page still on the GPU never pushes out the only copy of
        another)."""
        if self.host is not None:
            looked = saved = 0
            for block in self.pool.free_in_eviction_order():
                looked += 1
                if looked > WRITEBACK_WINDOW or saved >= WRITEBACK_PER_STEP:
                    break
                if block.block_hash is None or block.block_hash in self.host:
                    continue
                slot = self.host.reserve(block.block_hash, block.lease_until, evict=False)
                if slot is None:
                    break
                self.writebacks.append((block.block_id, slot))
                self.prefix_stats.offloaded_blocks += 1
                saved += 1
            self.host.end_step()
        copies = (self.offloads, self.loads, self.writebacks)
        self.offloads, self.loads, self.writebacks = [], [], []
        return copies

    def expire_leases(self) -> None:
        self.pool.expire_leases()
        if self.host is not None:
            self.host.expire_leases(self.clock())

    @property
    def num_live_sessions(self) -> int:
        self._drop_ended_sessions()
        return len(self.sessions)

    def live_sessions(self, limit: int) -> list[tuple[str, float]]:
        """(session key, seconds its lease has left) of up to `limit` sessions, longest first."""
        self._drop_ended_sessions()
        now = self.clock()
        ends = heapq.nlargest(limit, self.sessions.items(), key=lambda item: item[1])
        return [(key, round(end - now, 3)) for key, end in ends]

    def _drop_ended_sessions(self) -> None:
        now, heap = self.clock(), self._session_ends
        while heap and heap[0][0] <= now:  # entries a longer lease replaced are skipped
            end, key = heapq.heappop(heap)
            if self.sessions.get(key) == end:
                del self.sessions[key]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.clear()
        self.sessions.clear()
        self._session_ends.clear()
        return True

    def tier_stats(self, page_bytes: int) -> KVTierStats | None:
        """Both tiers' counts for the stats (`page_bytes`: one page over all ranks)."""
        if not self.enable_caching:
            return None
        s, host = self.prefix_stats, self.host
        return KVTierStats(
            query_tokens=s.queries,
            gpu_hit_tokens=s.hits - s.host_hits,
            cpu_hit_tokens=s.host_hits,
            offloaded_blocks=s.offloaded_blocks,
            loaded_blocks=s.loaded_blocks,
            offloaded_bytes=s.offloaded_blocks * page_bytes,
            loaded_bytes=s.loaded_blocks * page_bytes,
            cpu_pages_total=host.num_slots if host is not None else 0,
            cpu_pages_used=len(host) if host is not None else 0,
            leased_blocks=self.pool.num_leased_free_blocks,
            leased_cpu_pages=host.num_leased if host is not None else 0,
            sessions=self.num_live_sessions,
            leased_evicted_blocks=self.pool.num_evicted_leased
            + (host.num_evicted_leased if host is not None else 0),
        )


def _reads_every_prompt_token(request: Request) -> bool:
    """Prompt logprobs and MEAN/CLS pooling need every prompt position computed: no hits."""
    pooling = request.pooling_params
    return request.sampling_params.prompt_logprobs is not None or (
        pooling is not None and pooling.needs_every_token
    )
