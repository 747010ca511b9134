"""The CPU tier seen by the router: the tier's KV events, replayed exactly, and hits found only
there priced at `cpu_hit_cost` of a token to compute."""

from __future__ import annotations

import pytest

from inferengine.core.block_pool import (
    KV_CLEARED,
    KV_CPU_CLEARED,
    KV_CPU_REMOVED,
    KV_CPU_STORED,
    KV_STORED,
)
from inferengine.core.hashing import hash_prompt_blocks
from inferengine.core.host_tier import HostTier
from inferengine.dp.router import Router, RouterConfig
from tests.core.helpers import fake_runner_output, make_request, make_scheduler

BS = 4
PROMPT = list(range(10, 26))  # 16 tokens: 4 full blocks
H = hash_prompt_blocks(PROMPT, BS)[:3]  # the 3 a cache could serve (one token left to compute)


def router(n: int = 2, **kw) -> Router:
    kw = {"load_cost_tokens": 4.0, "kv_usage_cost_tokens": 0.0, **kw}
    return Router(n, RouterConfig(block_size=BS, **kw))


def events(kind: int, hs: list[bytes]) -> list[tuple[int, bytes]]:
    return [(kind, h) for h in hs]


def test_the_tier_reports_what_it_stores_drops_and_clears():
    tier = HostTier(2)
    tier.kv_events = []
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    assert tier.reserve(a) == 0 and tier.reserve(b, lease_until=5.0) == 1
    tier.end_step()
    tier.lease(a, 9.0)  # moving between its orders stores and drops nothing
    tier.expire_leases(now=6.0)
    assert tier.reserve(c, evict=False) is None  # full, and told not to evict: no event
    assert tier.reserve(c) == 1  # b's lease ran out: b goes first
    tier.clear()
    assert tier.kv_events == [
        (KV_CPU_STORED, a),
        (KV_CPU_STORED, b),
        (KV_CPU_REMOVED, b),
        (KV_CPU_STORED, c),
        (KV_CPU_CLEARED, b""),
    ]


def _run(sched, out):
    return sched.update_from_output(out, fake_runner_output(sched, out, lambda r: 50))


def _replayed_exactly(r: Router, sched) -> None:
    kv = sched.kv_cache_manager
    r.apply_kv_events(0, kv.take_kv_events())
    view = r.replicas[0]
    assert view.cached == set(kv.pool.cached)
    assert len(view.cpu_cached) == len(kv.host) and all(h in kv.host for h in view.cpu_cached)


def test_a_replica_s_events_replay_both_tiers_exactly_and_hits_match_the_engine_s():
    # 4 usable pages of 8 tokens, 3 host slots (the scenario of tests/core/test_kv_tiers.py)
    sched = make_scheduler(num_blocks=5, block_size=8, num_host_blocks=3)
    sched.kv_cache_manager.enable_kv_events()
    r = Router(1, RouterConfig(block_size=8))
    a_prompt = list(range(10, 26))
    a_hashes = hash_prompt_blocks(a_prompt, 8)
    sched.add_request(make_request("a", a_prompt, max_tokens=1))
    _run(sched, sched.schedule())
    _replayed_exactly(r, sched)
    assert r.replicas[0].cached == set(a_hashes) and not r.replicas[0].cpu_cached
    # b takes every page: a's two are saved to the host first, then one of b's ahead of time
    sched.add_request(make_request("b", list(range(30, 62)), max_tokens=1))
    _run(sched, sched.schedule())
    sched.schedule()
    _replayed_exactly(r, sched)
    assert set(a_hashes) <= r.replicas[0].cpu_cached and len(r.replicas[0].cpu_cached) == 3
    # what the router expects of a's prefix is what the engine finds: 2 pages, host only
    probe = [*a_prompt, 5, 6]
    assert r.replicas[0].hit_blocks(hash_prompt_blocks(probe, 8, max_blocks=2)) == (0, 2)
    sched.add_request(make_request("a2", probe, max_tokens=1))
    out = sched.schedule()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16 and len(out.kv_loads) == 2
    _run(sched, out)
    _replayed_exactly(r, sched)
    # a reset drops both tiers
    sched.schedule()
    assert sched.kv_cache_manager.reset_prefix_cache()
    kinds = [kind for kind, _ in sched.kv_cache_manager.pool.kv_events]
    assert kinds[-2:] == [KV_CLEARED, KV_CPU_CLEARED]
    _replayed_exactly(r, sched)
    assert not r.replicas[0].cached and not r.replicas[0].cpu_cached


@pytest.mark.parametrize(
    ("cpu_hit_cost", "costs", "picked"),
    [
        # replica 0 holds 1 block on its GPU; replica 1 the 3 blocks in its CPU tier only
        (0.0, (12.0, 4.0), 1),
        (0.25, (12.0, 7.0), 1),  # the default
        (2 / 3, (12.0, 12.0), 0),  # a tie: the lower id
        (1.0, (12.0, 16.0), 0),  # a CPU hit worth nothing: as before the tier was seen
    ],
)
def test_tokens_found_only_in_the_cpu_tier_cost_a_fraction(cpu_hit_cost, costs, picked):
    r = router(cpu_hit_cost=cpu_hit_cost)
    r.apply_kv_events(0, events(KV_STORED, H[:1]))
    r.apply_kv_events(1, events(KV_CPU_STORED, H))
    d = r.route("a", H, 16)
    assert d.costs == pytest.approx(costs) and d.replica_id == picked
    hits = (4, 0) if picked == 0 else (12, 12)
    assert (d.reason, d.cached_tokens, d.cpu_cached_tokens) == ("prefix", *hits)


def test_the_cpu_run_continues_the_gpu_run_as_the_engine_looks_up():
    r = router(1)
    h0, h1, h2 = H
    r.apply_kv_events(0, events(KV_STORED, [h0, h2]) + events(KV_CPU_STORED, [h1]))
    assert r.replicas[0].hit_blocks(H) == (1, 1)  # h2 is on the GPU, after the CPU run: a miss
    d = r.route("a", H, 16)
    assert d.costs == (8.0 + 0.25 * 4,)
    assert (d.cached_tokens, d.cpu_cached_tokens) == (8, 4)
    r.finish("a")
    r.apply_kv_events(0, [(KV_CLEARED, b""), *events(KV_CPU_STORED, [h0, h1, h2])])
    assert r.replicas[0].hit_blocks(H) == (0, 3)
    r.apply_kv_events(0, events(KV_STORED, [h0, h1]))
    assert r.replicas[0].hit_blocks(H) == (2, 1)  # blocks in both tiers count as on the GPU
    r.apply_kv_events(0, [(KV_CPU_REMOVED, h2)])
    assert r.replicas[0].hit_blocks(H) == (2, 0)
    r.apply_kv_events(0, [(KV_CPU_CLEARED, b"")])
    assert r.replicas[0].cpu_cached == set() and r.replicas[0].cached == {h0, h1}


def test_a_request_in_flight_makes_its_blocks_gpu_hits_there():
    r = router()
    r.apply_kv_events(0, events(KV_CPU_STORED, H))
    first = r.route("a", H, 16)  # CPU hits: 4 + 0.25 x 12 = 7 against 16
    assert (first.replica_id, first.cpu_cached_tokens) == (0, 12)
    second = r.route("b", H, 16)  # a's pages are being loaded there: GPU hits now
    assert second.costs == (4.0 + 4.0, 16.0)
    assert (second.replica_id, second.cached_tokens, second.cpu_cached_tokens) == (0, 12, 0)


def test_a_replica_down_or_back_forgets_its_cpu_tier_too():
    r = router()
    r.apply_kv_events(0, events(KV_CPU_STORED, H))
    r.mark_down(0)
    assert r.replicas[0].cpu_cached == set()
    r.apply_kv_events(1, events(KV_CPU_STORED, H))
    r.mark_up(1)
    assert r.replicas[1].cpu_cached == set()
