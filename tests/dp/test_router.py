"""The router's decisions, exactly: prefix cache from KV events, load, sessions, failover."""

from __future__ import annotations

import pytest

from inferengine.core.block_pool import KV_CLEARED, KV_REMOVED, KV_STORED, BlockPool
from inferengine.core.hashing import hash_prompt_blocks
from inferengine.dp.router import Router, RouterConfig
from inferengine.errors import EngineDeadError
from tests.core.helpers import make_request

BS = 4
INF = float("inf")


def hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return hash_prompt_blocks(tokens, BS, salt)


def router(n: int = 2, **kw) -> Router:
    kw = {"load_cost_tokens": 4.0, "kv_usage_cost_tokens": 0.0, **kw}
    config = RouterConfig(block_size=BS, **kw)
    return Router(n, config)


def stored(hs: list[bytes]) -> list[tuple[int, bytes]]:
    return [(KV_STORED, h) for h in hs]


PROMPT = list(range(10, 26))  # 16 tokens: 4 full blocks


def test_prompt_hashes_are_the_engine_hasher_s_with_and_without_salt():
    for salt in (None, "s"):
        request = make_request("r", [*PROMPT, 1, 2], block_size=BS, cache_salt=salt)
        assert hash_prompt_blocks([*PROMPT, 1, 2], BS, salt) == request.block_hashes
        assert (
            hash_prompt_blocks([*PROMPT, 1, 2], BS, salt, max_blocks=2)
            == (request.block_hashes[:2])
        )
    assert hashes(PROMPT) != hashes(PROMPT, "s")


def test_a_request_goes_where_its_prefix_is_cached_despite_some_load():
    r = router()
    r.apply_kv_events(1, stored(hashes(PROMPT)[:3]))
    r.replicas[1].in_flight = 2  # as if two requests were running there
    d = r.route("a", hashes(PROMPT)[:3], 16)
    # replica 0: 16 tokens to compute; replica 1: 4 to compute + 2 in flight x 4
    assert d.costs == (16.0, 12.0)
    assert (d.replica_id, d.reason, d.cached_tokens) == (1, "prefix", 12)
    # Enough load outweighs the cache.
    r.replicas[1].in_flight = 5
    d = r.route("b", hashes(PROMPT)[:3], 16)
    assert d.costs == (16.0, 4.0 + 5 * 4.0)
    assert (d.replica_id, d.reason) == (0, "load")


def test_only_a_leading_run_of_blocks_counts():
    r = router()
    h = hashes(PROMPT)
    r.apply_kv_events(1, stored([h[1], h[2]]))  # not the first block: no hit
    d = r.route("a", h[:3], 16)
    assert (d.replica_id, d.cached_tokens) == (0, 0)


def test_ties_go_to_fewer_in_flight_then_fewer_served_then_lower_id():
    r = router(kv_usage_cost_tokens=0.0)
    other = hashes(list(range(100, 116)))
    assert r.route("a", [], 8).replica_id == 0
    # replica 0 has one in flight: its cost is higher
    assert r.route("b", [], 8).replica_id == 1
    r.finish("a")
    r.finish("b")
    r.finish("x")  # unknown ids are ignored
    assert [v.served for v in r.replicas] == [1, 1]
    assert r.route("c", other, 16).replica_id == 0
    r.finish("c")
    assert r.route("d", [], 16).replica_id == 1  # equal cost and load, fewer served


def test_a_burst_sharing_a_prefix_follows_the_first_before_any_kv_event():
    r = router()
    h = hashes(PROMPT)[:3]
    first = r.route("a", h, 16)
    second = r.route("b", h, 16)
    assert first.replica_id == second.replica_id == 0
    assert (second.reason, second.cached_tokens) == ("prefix", 12)
    assert r.replicas[0].in_flight == 2
    # Once both finish, only what the replica's events say counts.
    r.finish("a")
    r.finish("b")
    assert not r.replicas[0].pending
    d = r.route("c", h, 16)
    assert d.cached_tokens == 0


def test_kv_events_replay_the_pool_exactly():
    pool = BlockPool(8)
    pool.kv_events = []
    r = router(1)
    request = make_request("r", [*PROMPT, 1], block_size=BS)
    blocks = pool.get_new_blocks(4)
    for block, block_hash in zip(blocks, request.block_hashes, strict=True):
        pool.cache_block(block, block_hash)
    pool.cache_block(blocks[0], request.block_hashes[0])  # already cached: no event
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(5)  # 3 never-cached blocks, then evicts the request's last two
    r.apply_kv_events(0, pool.kv_events)
    assert r.replicas[0].cached == set(pool.cached) == set(request.block_hashes[:2])
    kinds = [kind for kind, _ in pool.kv_events]
    assert kinds == [KV_STORED] * 4 + [KV_REMOVED] * 2
    r.apply_kv_events(0, [(KV_CLEARED, b"")])
    assert r.replicas[0].cached == set()


def test_reset_prefix_cache_is_one_cleared_event():
    pool = BlockPool(4)
    pool.kv_events = []
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, b"h" * 16)
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.kv_events == [(KV_STORED, b"h" * 16), (KV_CLEARED, b"")]


def test_a_far_busier_replica_is_passed_over_whatever_it_caches():
    r = router(balance_abs=3, balance_ratio=1.5)
    h = hashes(PROMPT)[:3]
    r.apply_kv_events(0, stored(h))
    r.replicas[0].in_flight = 4
    r.replicas[1].in_flight = 0
    d = r.route("a", h, 16)
    assert d.costs == (INF, 16.0)
    assert (d.replica_id, d.reason) == (1, "load")


def test_kv_usage_adds_to_the_cost():
    r = router(kv_usage_cost_tokens=10.0)
    r.update_load(0, num_running=3, num_waiting=1, kv_usage=0.5)
    d = r.route("a", [], 8)
    assert d.costs == (13.0, 8.0) and d.replica_id == 1
    assert (r.replicas[0].num_running, r.replicas[0].num_waiting) == (3, 1)


def test_a_session_stays_on_its_replica_until_that_replica_goes_down():
    r = router()
    h = hashes(PROMPT)[:3]
    assert r.route("a", [], 16, session="s").replica_id == 0
    r.apply_kv_events(1, stored(h))  # cheaper elsewhere: the session stays anyway
    d = r.route("b", h, 16, session="s")
    assert (d.replica_id, d.reason) == (0, "session")
    r.mark_down(0)
    d = r.route("c", h, 16, session="s")
    assert (d.replica_id, d.reason) == (1, "prefix")
    r.mark_up(0)
    assert r.route("d", [], 16, session="s").replica_id == 1  # rebound to replica 1
    assert r.decisions == {"session": 2, "prefix": 1, "load": 1}


def test_sessions_are_bounded_least_recently_used_first():
    r = router(max_sessions=2)
    for i, key in enumerate(("x", "y", "x", "z")):
        r.route(f"r{i}", [], 4, session=key)
    assert list(r.sessions) == ["x", "z"]


def test_a_down_replica_gets_nothing_and_forgets_its_cache():
    r = router()
    h = hashes(PROMPT)[:3]
    r.apply_kv_events(0, stored(h))
    r.route("a", h, 16)
    r.mark_down(0)
    assert r.replicas[0].cached == set()
    d = r.route("a2", h, 16, rerouted=True)
    assert d.costs == (INF, 16.0) and d.replica_id == 1
    assert r.rerouted == 1
    assert r.replica_of("a") == 0  # still counted there until finished
    assert r.finish("a", served=False) == 0
    assert r.replicas[0].in_flight == 0 and r.replicas[0].served == 0
    r.mark_down(1)
    with pytest.raises(EngineDeadError):
        r.route("b", h, 16)
    assert r.num_up == 0


def test_shared_prefixes_keep_one_replica_s_hits_where_round_robin_keeps_half():
    """7 groups x 3 requests, interleaved, each request finishing before the next: replicas
    that store every prompt block (their KV events) against a single cache and round-robin."""
    prompts = [
        [100 + g] * 32 + [200 + g * 3 + i] * 4 for i in range(3) for g in range(7)
    ]  # 32-token shared prefix (8 blocks), 4-token tail: 8 blocks a cache can serve

    def served_hits(pick) -> int:
        caches: list[set[bytes]] = [set(), set()]
        total = 0
        for i, prompt in enumerate(prompts):
            h = hash_prompt_blocks(prompt, BS, max_blocks=(len(prompt) - 1) // BS)
            replica = pick(i, h)
            hits = next((n for n, x in enumerate(h) if x not in caches[replica]), len(h))
            total += hits * BS
            caches[replica].update(h)
            r.apply_kv_events(replica, stored(h))
        return total

    r = router()
    single = served_hits(lambda i, h: 0)
    r = router()

    def routed(i: int, h: list[bytes]) -> int:
        replica = r.route(f"r{i}", h, 36).replica_id
        r.finish(f"r{i}")
        return replica

    assert served_hits(routed) == single == 7 * 2 * 32
    assert served_hits(lambda i, h: i % 2) == single // 2
    assert all(v.served > 0 for v in r.replicas)
