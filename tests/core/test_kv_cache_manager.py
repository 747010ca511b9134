"""KVCacheManager: exact block ids for allocation, prefix hits, freeing order and failed allocation."""

from __future__ import annotations

import random

from inferengine.core.kv_cache_manager import KVCacheManager
from inferengine.core.request import Request
from tests.core.helpers import check_manager, free_ids, make_request

BS = 4


def manager(num_blocks: int = 10, enable_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, enable_caching)


def req(request_id: str, prompt: list[int], **kwargs) -> Request:
    return make_request(request_id, prompt, block_size=BS, **kwargs)


def admit(kv: KVCacheManager, request: Request) -> list[int]:
    """What the scheduler does for a waiting request: look up hits, allocate the rest, compute."""
    hits, num_hit_tokens = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    assert kv.allocate_slots(request, num_new, hits, num_hit_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    return kv.get_block_ids(request.request_id)


def snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (
        free_ids(pool),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        dict(pool.cached),
        {rid: kv.get_block_ids(rid) for rid in kv.req_to_blocks},
        dict(kv.num_cached_blocks),
        pool.num_cached_free_blocks,
    )


def test_allocate_hashes_full_blocks_only():
    kv = manager()
    r = req("r", list(range(10)))
    new = kv.allocate_slots(r, 10)
    assert [b.block_id for b in new] == [1, 2, 3]
    assert [b.block_hash for b in new] == [*r.block_hashes, None]
    assert kv.pool.get_cached_block(r.block_hashes[1]).block_id == 2
    r.num_computed_tokens = 10
    r.append_output_token_ids([50])
    assert kv.allocate_slots(r, 1) == []  # token 11 still fits block 3
    r.num_computed_tokens = 11
    r.append_output_token_ids([51])
    assert kv.allocate_slots(r, 1) == []  # token 12 fills block 3, which gets its hash
    assert kv.pool.blocks[3].block_hash == r.block_hashes[2]
    r.num_computed_tokens = 12
    r.append_output_token_ids([52])
    assert [b.block_id for b in kv.allocate_slots(r, 1)] == [4]
    check_manager(kv)


def test_free_order_and_prefix_hit_returns_the_same_blocks():
    kv = manager()
    a = req("a", list(range(10)))
    assert admit(kv, a) == [1, 2, 3]
    kv.free(a)
    # Block 3 (no hash) goes to the front; the cached 2 and 1 to the tail, last block first.
    assert free_ids(kv.pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert kv.pool.num_cached_free_blocks == 2
    b = req("b", [*range(8), 100, 101, 102])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2] and num_hit_tokens == 8
    assert kv.allocate_slots(b, 3, hits, num_hit_tokens)[0].block_id == 3
    assert kv.get_block_ids("b") == [1, 2, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 1]
    b.num_computed_tokens = 11
    c = req("c", [*range(8), 200])
    assert admit(kv, c) == [1, 2, 4]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    check_manager(kv)
    kv.free(b)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 0]
    check_manager(kv)


def test_hits_stop_at_the_first_miss():
    kv = manager()
    admit(kv, req("a", [*range(8), 7, 7, 7, 7, 0]))
    b = req("b", [0, 1, 2, 3, 9, 9, 9, 9, 7, 7, 7, 7, 0])  # block 1 differs, block 2 equal
    hits, n = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1] and n == 4


def test_a_prompt_of_exactly_n_full_blocks_hits_at_most_n_minus_1():
    kv = manager()
    prompt = list(range(12))
    assert admit(kv, req("a", prompt)) == [1, 2, 3]
    assert kv.pool.blocks[3].block_hash is not None  # all three blocks are cached
    b = req("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2] and n == 8
    assert kv.allocate_slots(b, 4, hits, n)[0].block_id == 4
    # Block 4 holds what block 3 holds; the hash stays with block 3.
    assert kv.pool.blocks[4].block_hash is None
    assert kv.pool.get_cached_block(b.block_hashes[2]).block_id == 3
    one = req("c", [0])
    assert kv.get_computed_blocks(one) == ([], 0)


def test_different_salts_never_share_blocks():
    kv = manager(20)
    prompt = list(range(9))
    admit(kv, req("plain", prompt))
    admit(kv, req("alice", prompt, cache_salt="alice"))
    for name, salt, expected in [
        ("p2", None, [1, 2]),
        ("a2", "alice", [4, 5]),
        ("b2", "bob", []),
    ]:
        hits, _ = kv.get_computed_blocks(req(name, prompt, cache_salt=salt))
        assert [b.block_id for b in hits] == expected, name


def test_blocks_of_scheduled_but_uncomputed_tokens_lose_their_hash_on_free():
    kv = manager()
    r = req("r", list(range(13)))
    r.num_computed_tokens = 4  # block 1 was computed in an earlier step
    kv.allocate_slots(r, 9)  # this step registers blocks 2 and 3 ...
    assert all(kv.pool.blocks[i].block_hash is not None for i in (1, 2, 3))
    kv.free(r)  # ... but the request is preempted before they are computed
    assert kv.pool.blocks[1].block_hash == r.block_hashes[0]
    assert kv.pool.blocks[2].block_hash is None and kv.pool.blocks[3].block_hash is None
    assert list(kv.pool.cached) == [r.block_hashes[0]]
    assert free_ids(kv.pool) == [2, 3, 4, 5, 6, 7, 8, 9, 1]
    hits, _ = kv.get_computed_blocks(req("s", list(range(13))))
    assert [b.block_id for b in hits] == [1]
    check_manager(kv)


def test_failed_allocation_returns_none_and_changes_nothing():
    kv = manager(6)  # 5 usable blocks
    a = req("a", list(range(8)))
    admit(kv, a)  # blocks 1, 2
    kv.free(a)  # both cached, free
    admit(kv, req("x", [50] * 8))  # blocks 3, 4 (free list was [3, 4, 5, 2, 1])
    assert free_ids(kv.pool) == [5, 2, 1]
    # Hits on 1 and 2 (both in the free list) leave 1 free block, the request needs 2 more.
    b = req("b", [*range(8), *range(100, 108)])
    hits, n = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2]
    before = snapshot(kv)
    assert kv.allocate_slots(b, 8, hits, n) is None
    assert snapshot(kv) == before
    assert "b" not in kv.req_to_blocks
    # One block fewer fits exactly.
    assert [blk.block_id for blk in kv.allocate_slots(b, 4, hits, n)] == [5]
    assert kv.pool.num_free_blocks == 0
    check_manager(kv)
    c = req("c", [1])
    before = snapshot(kv)
    assert kv.allocate_slots(c, 1) is None
    assert snapshot(kv) == before


def test_eviction_takes_the_least_recently_freed_cached_block():
    kv = manager(7)  # 6 usable
    a, b = req("a", list(range(8))), req("b", list(range(100, 108)))
    assert admit(kv, a) == [1, 2] and admit(kv, b) == [3, 4]
    kv.free(a)
    kv.free(b)
    assert free_ids(kv.pool) == [5, 6, 2, 1, 4, 3]
    admit(kv, req("x", list(range(200, 212))))  # 3 blocks: 5, 6, then evicts 2
    assert kv.get_block_ids("x") == [5, 6, 2]
    hits, _ = kv.get_computed_blocks(req("a2", list(range(9))))
    assert [blk.block_id for blk in hits] == [1]  # a's second block was evicted
    assert a.block_hashes[1] not in kv.pool.cached
    check_manager(kv)


def test_prompt_logprobs_and_disabled_caching_skip_the_cache():
    kv = manager()
    admit(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9)), prompt_logprobs=1)) == ([], 0)
    off = manager(enable_caching=False)
    admit(off, req("a", list(range(9))))
    assert off.pool.cached == {}
    assert off.get_computed_blocks(req("b", list(range(9)))) == ([], 0)


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    kv = manager()
    a = req("a", list(range(9)))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    check_manager(kv)


def test_random_admit_and_free_keeps_the_counters_consistent():
    rng = random.Random(0)
    kv = manager(12)
    live: list[Request] = []
    for i in range(400):
        if live and (rng.random() < 0.45 or kv.pool.num_free_blocks < 4):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            prefix = [rng.randrange(3)] * rng.choice([0, 4, 8])
            prompt = prefix + [rng.randrange(3) for _ in range(rng.randint(1, 6))]
            r = req(f"r{i}", prompt, cache_salt=rng.choice([None, None, "s"]))
            hits, n = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, r.num_tokens - n, hits, n) is None:
                assert r.request_id not in kv.req_to_blocks
                continue
            r.num_computed_tokens = r.num_tokens
            live.append(r)
        check_manager(kv)
        for r in live:
            blocks = kv.req_to_blocks[r.request_id]
            for i_block, block_hash in enumerate(r.block_hashes):
                held = blocks[i_block].block_hash
                assert held is None or held == block_hash
