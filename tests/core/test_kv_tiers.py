"""The CPU tier and session leases in the scheduler: exact pages, slots and copies."""

from __future__ import annotations

import pytest

from inferengine.core.host_tier import HostTier
from tests.core.helpers import check_manager, fake_runner_output, make_request, make_scheduler


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _scheduler(num_blocks: int, num_host_blocks: int = 0, clock: Clock | None = None):
    sched = make_scheduler(num_blocks=num_blocks, block_size=8, num_host_blocks=num_host_blocks)
    if clock is not None:
        sched.kv_cache_manager.clock = sched.kv_cache_manager.pool.clock = clock
    return sched


def _run(sched, out):
    return sched.update_from_output(out, fake_runner_output(sched, out, lambda r: 50))


def test_evicted_pages_go_to_the_cpu_tier_and_a_later_hit_loads_them_back():
    sched = _scheduler(num_blocks=5, num_host_blocks=3)  # 4 usable pages of 8 tokens
    a_prompt = list(range(10, 26))  # two full pages
    sched.add_request(make_request("a", a_prompt, max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].block_ids == [1, 2] and not out.kv_offloads
    _run(sched, out)
    # b needs all four pages: a's two cached pages are evicted, so saved first (slots 0, 1).
    sched.add_request(make_request("b", list(range(30, 62)), max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].block_ids == [3, 4, 2, 1]
    assert out.kv_offloads == [(2, 0), (1, 1)] and out.kv_loads == []
    _run(sched, out)
    # An idle step saves the page next in line for eviction into the one free slot; it never
    # pushes out a's pages, whose only copy is on the host.
    out = sched.schedule()
    assert out.kv_writebacks == [(1, 2)] and out.kv_offloads == out.kv_loads == []
    # a's prefix again: both pages come back from the host into fresh pages, the GPU page
    # they land on first saved (b's third page goes to slot 2, the least recently used).
    sched.add_request(make_request("a2", [*a_prompt, 5, 6], max_tokens=1))
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.block_ids == [1, 2, 4] and new.num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"a2": 2}
    assert out.kv_offloads == [(2, 2)] and out.kv_loads == [(1, 1), (0, 2)]
    (done,) = _run(sched, out).outputs
    assert done.num_cached_tokens == 16
    tiers = sched.make_stats().kv_tiers
    assert (tiers.cpu_hit_tokens, tiers.gpu_hit_tokens, tiers.loaded_blocks) == (16, 0, 2)
    assert (tiers.offloaded_blocks, tiers.cpu_pages_used, tiers.cpu_pages_total) == (4, 3, 3)
    check_manager(sched.kv_cache_manager)


def test_a_gpu_hit_continues_into_the_cpu_tier():
    sched = _scheduler(num_blocks=5, num_host_blocks=4)
    prompt = list(range(100, 124))  # three full pages
    sched.add_request(make_request("a", prompt, max_tokens=1))
    _run(sched, sched.schedule())
    # Only a's last page is evicted (b needs two pages: the never-used page and one more) and
    # saved first; the end of the step saves a's other pages ahead of time into free slots.
    sched.add_request(make_request("b", list(range(200, 212)), max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].block_ids == [4, 3]
    assert out.kv_offloads == [(3, 0)] and out.kv_writebacks == [(2, 1), (1, 2)]
    _run(sched, out)
    sched.add_request(make_request("a2", [*prompt, 7], max_tokens=1))
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.block_ids[:2] == [1, 2] and new.num_computed_tokens == 24
    assert out.kv_loads == [(0, new.block_ids[2])]


def test_leased_pages_are_evicted_after_every_unleased_one_until_the_lease_ends():
    clock = Clock()
    sched = _scheduler(num_blocks=7, clock=clock)  # 6 usable pages
    kept = make_request("kept", list(range(10, 26)), max_tokens=1)
    kept.cache_key, kept.cache_ttl_s = "session-1", 60.0
    plain = make_request("plain", list(range(40, 56)), max_tokens=1)
    sched.add_request(kept)
    sched.add_request(plain)
    out = sched.schedule()
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[1, 2], [3, 4]]
    _run(sched, out)
    stats = sched.make_stats().kv_tiers
    assert (stats.leased_blocks, stats.sessions) == (2, 1)
    # Four pages wanted: the two never used, then plain's (unleased), never kept's.
    sched.add_request(make_request("big", list(range(70, 102)), max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].block_ids == [5, 6, 4, 3]
    _run(sched, out)
    sched.add_request(make_request("again", [*range(10, 26), 1], max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16  # the session's prefix survived
    _run(sched, out)
    clock.now += 61  # the lease ends: the pages wait in the plain order, first to go
    sched.schedule()
    stats = sched.make_stats().kv_tiers
    assert (stats.leased_blocks, stats.sessions, stats.leased_evicted_blocks) == (0, 0, 0)
    check_manager(sched.kv_cache_manager)


def test_a_breakpoint_leases_only_the_prefix_it_marks():
    clock = Clock()
    sched = _scheduler(num_blocks=9, clock=clock)
    request = make_request("r", list(range(10, 42)), max_tokens=1)  # four full pages
    request.cache_breakpoints = [(17, 300.0)]  # two whole pages lie within 17 tokens
    sched.add_request(request)
    _run(sched, sched.schedule())
    pool = sched.kv_cache_manager.pool
    assert sorted(b.block_id for b in pool.leased_queue) == [1, 2]
    assert all(pool.blocks[i].lease_until == clock.now + 300.0 for i in (1, 2))


def test_when_only_leased_pages_are_left_they_are_evicted_and_counted():
    clock = Clock()
    sched = _scheduler(num_blocks=3, clock=clock)  # 2 usable pages
    kept = make_request("kept", list(range(10, 26)), max_tokens=1)
    kept.cache_ttl_s = 3600.0
    sched.add_request(kept)
    _run(sched, sched.schedule())
    sched.add_request(make_request("next", list(range(50, 60)), max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].block_ids == [2, 1]
    assert sched.make_stats().kv_tiers.leased_evicted_blocks == 2


def test_host_tier_gives_away_unleased_slots_first_and_never_a_busy_one():
    tier = HostTier(3)
    assert [tier.reserve(h) for h in (b"a", b"b")] == [0, 1]
    assert tier.reserve(b"c", lease_until=99.0) == 2
    tier.end_step()
    assert tier.lookup(b"a") == 0  # now busy and most recently used
    assert tier.reserve(b"d") == 1  # b: the least recently used unleased slot
    # a and d are busy this step: only the leased slot is left, and it goes, counted.
    assert tier.reserve(b"e") == 2 and b"c" not in tier and tier.num_evicted_leased == 1
    tier.end_step()
    assert tier.reserve(b"f") == 0  # a: unleased, least recently used


def test_host_tier_leases_end():
    tier = HostTier(2)
    tier.reserve(b"kept", lease_until=100.0)
    tier.reserve(b"plain")
    tier.end_step()
    assert tier.reserve(b"x") == 1  # the unleased one goes first
    tier.end_step()
    tier.expire_leases(now=100.0)
    assert tier.num_leased == 0 and tier.reserve(b"y") == 0  # stale: first to go


@pytest.mark.parametrize("evict", [True, False])
def test_host_tier_without_eviction_uses_only_free_slots(evict):
    tier = HostTier(1)
    assert tier.reserve(b"a") == 0
    tier.end_step()
    assert (tier.reserve(b"b", evict=evict) is not None) == evict


def test_a_request_that_waits_for_pages_is_counted_once():
    sched = _scheduler(num_blocks=4)  # 3 usable pages
    sched.add_request(make_request("a", list(range(10, 26)), max_tokens=3))
    sched.add_request(make_request("b", list(range(40, 56)), max_tokens=1))
    for _ in range(5):  # b is looked up at every step until a's pages come back
        _run(sched, sched.schedule())
    assert not sched.has_unfinished_requests()
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (32, 0)
