"""`BlockPool`: the KV pages, their reference counts, the LRU free list and the prefix-cache map.

Block 0 is the null block: never handed out, it pads block tables. A freed block keeps its hash
and waits in the free list, so a later request with the same prefix can take it back; blocks with
no hash sit at the front of the list and are reused first, cached ones in LRU order behind them.
A block whose session holds a lease (`lease_until` in the future) waits in a second list that is
drawn from only when the first is empty; a lease that runs out moves its block to the front of
the first. Reusing a cached block is an eviction, noted in `evicted` for the CPU tier.

KV events: with `kv_events` set to a list (a data-parallel replica does; off otherwise), every
change to which hashes the pool holds is appended in order: (KV_STORED, hash) when a hash
becomes findable, (KV_REMOVED, hash) when it stops being, (KV_CLEARED, b"") when all are dropped.
Replaying them gives exactly the keys of `cached`. The CPU tier (`HostTier`) appends its own to
the same list: KV_CPU_STORED, KV_CPU_REMOVED and KV_CPU_CLEARED (replayed: the hashes it holds).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from inferengine.core.hashing import BlockHash

KV_REMOVED, KV_STORED, KV_CLEARED = 0, 1, 2
KV_CPU_REMOVED, KV_CPU_STORED, KV_CPU_CLEARED = 3, 4, 5
KVEvent = tuple[int, BlockHash]


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    lease_until: float = 0.0  # a session keeps this page until then (monotonic seconds)
    in_leased_list: bool = False
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        tag = self.block_hash.hex()[:8] if self.block_hash else "-"
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={tag})"


class FreeBlockQueue:
    """Doubly linked list of free blocks; O(1) pop from the front, append and remove anywhere."""

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def _link_after(self, anchor: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: KVCacheBlock) -> None:
        assert self._tail.prev_free is not None
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        self._link_after(self._head, block)

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free list"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free block")
        self.remove(block)
        return block


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.clock = clock
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never handed out
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.leased_queue = FreeBlockQueue([])
        self._lease_heap: list[tuple[float, int]] = []  # (lease end, block id) of leased frees
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self._num_cached_free = 0  # free blocks that still hold a hash
        # (hash, block id, lease end) of cached blocks reused since the owner last looked.
        self.evicted: list[tuple[BlockHash, int, float]] = []
        self.track_evictions = False
        self.num_evicted_leased = 0
        self.kv_events: list[KVEvent] | None = None  # see the module docstring

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + len(self.leased_queue)

    @property
    def num_leased_free_blocks(self) -> int:
        """Free blocks a live lease keeps (evicted only after every other free block)."""
        return len(self.leased_queue)

    def free_in_eviction_order(self) -> Iterator[KVCacheBlock]:
        """Free blocks in the order they would be reused (cached or not)."""
        for queue in (self.free_queue, self.leased_queue):
            yield from queue

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (evictable)."""
        return self._num_cached_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self.free_queue:
                block = self.free_queue.popleft()
            else:
                block = self.leased_queue.popleft()
                block.in_leased_list = False
                self.num_evicted_leased += 1
            if block.block_hash is not None:
                self._num_cached_free -= 1
                if self.track_evictions:
                    self.evicted.append((block.block_hash, block.block_id, block.lease_until))
                self._drop_hash(block)
            block.lease_until = 0.0
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._unlink_free(block)
                self._num_cached_free -= block.block_hash is not None
            block.ref_cnt += 1

    def _unlink_free(self, block: KVCacheBlock) -> None:
        if block.in_leased_list:
            self.leased_queue.remove(block)
            block.in_leased_list = False
        else:
            self.free_queue.remove(block)

    def expire_leases(self) -> None:
        """Free blocks whose lease ran out join the plain list, first in line to be reused."""
        now = self.clock()
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            _, block_id = heapq.heappop(heap)
            block = self.blocks[block_id]
            if block.in_leased_list and block.lease_until <= now:
                self.leased_queue.remove(block)
                block.in_leased_list = False
                self.free_queue.appendleft(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under its hash; a hash already held by another block stays there."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            if self.kv_events is not None:
                self.kv_events.append((KV_STORED, block_hash))

    def uncache_block(self, block: KVCacheBlock) -> None:
        self._drop_hash(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free list.

        Give the blocks in eviction order (a request's last block first): cached blocks go to
        the tail in that order, blocks with no hash to the front, so they are reused first.
        """
        for block in ordered_blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                elif block.lease_until > self.clock():
                    self.leased_queue.append(block)
                    block.in_leased_list = True
                    heapq.heappush(self._lease_heap, (block.lease_until, block.block_id))
                    self._num_cached_free += 1
                else:
                    self.free_queue.append(block)
                    self._num_cached_free += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Only possible when no block is in use."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks[1:]:
            if block.in_leased_list:
                self.leased_queue.remove(block)
                block.in_leased_list = False
                self.free_queue.append(block)
            block.block_hash = None
            block.lease_until = 0.0
        self.cached.clear()
        self._lease_heap.clear()
        self._num_cached_free = 0
        if self.kv_events is not None:
            self.kv_events.append((KV_CLEARED, b""))
        return True

    def _drop_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.kv_events is not None:
                    self.kv_events.append((KV_REMOVED, block.block_hash))
            block.block_hash = None
