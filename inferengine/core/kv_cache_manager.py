"""`KVCacheManager`: which pages each request owns, prefix-cache lookups, and page accounting."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inferengine.core.block_pool import BlockPool, KVCacheBlock
from inferengine.core.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already hashed
        self.prefix_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of leading full blocks already in the cache, and the tokens they hold.

        At least one token is always left to compute, so the request still produces logits.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give `request` pages for `num_new_tokens` more tokens, after its prefix-cache hits.

        Returns the newly allocated blocks, or None (changing nothing) when too few are free.
        Full blocks that this step will fill are registered in the prefix cache right away, so a
        request scheduled later in the same step can share them (their K/V are written before
        any attention reads them, layer by layer).
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
        blocks.extend(new_blocks)
        if self.enable_caching:
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
        """Release the request's pages; the cached ones stay findable until evicted.

        Blocks registered for tokens that were scheduled but never computed (the request was
        preempted in the step that scheduled them) lose their hash first.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        first_uncomputed = request.num_computed_tokens // self.block_size
        for block in blocks[first_uncomputed:]:
            if block.ref_cnt == 1:
                self.pool.uncache_block(block)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
