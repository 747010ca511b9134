"""BlockPool: exact block ids handed out, LRU eviction order, hashes and reference counts."""

from __future__ import annotations

import pytest

from inferengine.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from inferengine.core.hashing import ROOT_HASH, hash_block
from tests.core.helpers import check_pool, free_ids


def h(i: int) -> bytes:
    return hash_block(ROOT_HASH, [i])


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_block_queue_links():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks[1:4])
    queue.appendleft(blocks[4])
    queue.append(blocks[0])
    assert [b.block_id for b in queue] == [4, 1, 2, 3, 0]
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [4, 1, 3, 0]
    assert queue.popleft() is blocks[4]
    assert len(queue) == 3
    with pytest.raises(AssertionError):
        queue.remove(blocks[2])  # not in the list any more
    for _ in range(3):
        queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_fresh_pool_hands_out_1_2_3_and_never_the_null_block():
    pool = BlockPool(6)
    assert pool.num_usable_blocks == pool.num_free_blocks == 5
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert all(b.ref_cnt == 1 for b in pool.blocks)


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError):
        BlockPool(1)


def test_free_puts_hashed_blocks_at_the_tail_in_order_and_unhashed_at_the_front():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(4)  # 1 2 3 4; 5 6 7 stay free
    pool.cache_block(blocks[0], h(0))
    pool.cache_block(blocks[1], h(1))
    # A request's blocks in eviction order: last block first.
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 5, 6, 7, 2, 1]
    assert pool.num_cached_free_blocks == 2
    check_pool(pool, {})
    # Reuse order: unhashed first, then the cached ones from the LRU end (block 2 before 1).
    assert ids(pool.get_new_blocks(5)) == [3, 4, 5, 6, 7]
    assert pool.get_cached_block(h(1)) is blocks[1]
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(h(1)) is None  # eviction drops the hash from the map
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(h(0)) is blocks[0]
    assert pool.num_cached_free_blocks == 1


def test_touch_takes_cached_free_blocks_back_and_counts_references():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(0))
    pool.free_blocks([a])
    assert pool.num_cached_free_blocks == 1 and free_ids(pool) == [3, 4, 1]
    pool.touch([a, b])  # a was free (ref 0), b is in use
    assert (a.ref_cnt, b.ref_cnt) == (1, 2)
    assert free_ids(pool) == [3, 4] and pool.num_cached_free_blocks == 0
    pool.touch([a])
    pool.free_blocks([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    check_pool(pool, {"x": [1, 2]})
    pool.free_blocks([a, b])
    check_pool(pool, {})
    with pytest.raises(AssertionError):
        pool.free_blocks([a])  # double free


def test_cache_block_keeps_the_first_holder_of_a_hash():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(0))
    pool.cache_block(b, h(0))
    assert pool.get_cached_block(h(0)) is a and b.block_hash is None
    pool.cache_block(a, h(1))  # a block keeps the hash it has
    assert a.block_hash == h(0) and pool.get_cached_block(h(1)) is None
    pool.uncache_block(b)  # not the holder: the map is untouched
    assert pool.get_cached_block(h(0)) is a
    pool.uncache_block(a)
    assert pool.cached == {} and a.block_hash is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, h(0))
    assert a.block_hash is None and pool.cached == {}


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, h(0))
    pool.cache_block(b, h(1))
    pool.free_blocks([b])
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(h(0)) is a and pool.get_cached_block(h(1)) is b
    pool.free_blocks([a])
    assert pool.num_cached_free_blocks == 2
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and pool.num_cached_free_blocks == 0
    assert all(blk.block_hash is None for blk in pool.blocks)
    check_pool(pool, {})
