"""`PDPolicy`: prefill engines by cached prefix (replayed KV events) net of load, decode engines by
load, exclusions for retries, engines going down and up."""

from __future__ import annotations

from inferengine.core.block_pool import KV_CLEARED, KV_REMOVED, KV_STORED
from inferengine.core.hashing import hash_prompt_blocks
from inferengine.dp.pd_policy import PDPolicy, parse_kv_events

BS = 4


def policy(num_prefill: int = 2, num_decode: int = 2) -> PDPolicy:
    p = PDPolicy(num_prefill, num_decode)
    p.set_block_size(BS)
    return p


def stored(ids: list[int], salt: str | None = None) -> list[tuple[int, bytes]]:
    return [(KV_STORED, h) for h in hash_prompt_blocks(ids, BS, salt)]


PROMPT = list(range(40))  # 10 full blocks


def test_prefill_goes_where_the_prefix_is_cached():
    p = policy(3)
    p.apply_kv_events(2, stored(PROMPT[:32]))
    decision = p.pick_prefill("a", PROMPT)
    assert decision is not None
    assert (decision.replica_id, decision.reason, decision.cached_tokens) == (2, "prefix", 32)


def test_prefill_hashes_follow_the_engines_scheme_with_salt():
    p = policy()
    p.apply_kv_events(1, stored(PROMPT, salt="s"))
    assert p.pick_prefill("a", PROMPT).replica_id == 0  # unsalted prompt: no hit, least served
    p.finish_prefill("a")
    decision = p.pick_prefill("b", PROMPT, cache_salt="s")
    assert (decision.replica_id, decision.cached_tokens) == (1, 40)


def test_removed_and_cleared_events_take_hits_away():
    p = policy()
    p.apply_kv_events(1, stored(PROMPT))
    p.apply_kv_events(1, [(KV_REMOVED, hash_prompt_blocks(PROMPT, BS)[0])])
    assert p.pick_prefill("a", PROMPT).cached_tokens == 0  # the chain breaks at block 0
    p.finish_prefill("a")
    p.apply_kv_events(0, stored(PROMPT))
    p.apply_kv_events(0, [(KV_CLEARED, b"")])
    assert p.pick_prefill("b", PROMPT).reason == "load"


def test_without_token_ids_prefill_is_by_load():
    p = policy()
    p.apply_kv_events(1, stored(PROMPT))
    first = p.pick_prefill("a", None)
    second = p.pick_prefill("b", None)
    assert {first.replica_id, second.replica_id} == {0, 1}  # the second avoids the busy one
    assert first.reason == second.reason == "load"


def test_a_burst_follows_the_first_request_of_its_prefix():
    p = policy()
    assert p.pick_prefill("a", PROMPT).replica_id == 0
    assert p.pick_prefill("b", PROMPT).replica_id == 0  # pending hashes count as cached


def test_excluded_and_down_engines_are_not_picked():
    p = policy(3)
    p.apply_kv_events(1, stored(PROMPT))
    assert p.pick_prefill("a", PROMPT, exclude={1}).replica_id in (0, 2)
    p.set_prefill_up(2, False)
    assert p.pick_prefill("a", PROMPT, exclude={0, 1}) is None
    assert p.num_prefill_up == 2


def test_a_retry_replaces_the_prefill_assignment():
    p = policy()
    p.pick_prefill("a", PROMPT)
    p.pick_prefill("a", PROMPT, exclude={0})
    assert [r.in_flight for r in p.prefill.replicas] == [0, 1]
    p.finish_prefill("a")
    assert [r.in_flight for r in p.prefill.replicas] == [0, 0]


def test_an_engine_back_up_starts_with_an_empty_index():
    p = policy()
    p.apply_kv_events(1, stored(PROMPT))
    p.set_prefill_up(1, False)
    p.set_prefill_up(1, True)
    assert p.pick_prefill("a", PROMPT).reason == "load"


def test_wants_prompt_ids_only_with_a_choice_and_a_block_size():
    p = PDPolicy(2, 1)
    assert not p.wants_prompt_ids()  # block size not reported yet
    p.set_block_size(BS)
    assert p.wants_prompt_ids()
    p.set_prefill_up(0, False)
    assert not p.wants_prompt_ids()  # one engine: nothing to choose


def test_decode_by_fewest_requests_then_tokens():
    p = policy(1, 3)
    assert p.pick_decode("a", 100) == 0
    assert p.pick_decode("b", 10) == 1
    assert p.pick_decode("c", 50) == 2
    p.finish_decode("a")
    p.finish_decode("c")
    # 0 and 2 have nothing in flight; 0 has served one, so does 2: id breaks the tie.
    assert p.pick_decode("d", 5) == 0
    assert p.pick_decode("e", 5) == 2
    # all hold one request now: the fewest tokens in flight wins (2: 5 tokens, 1: 10)
    assert [d.in_flight_tokens for d in p.decode] == [5, 10, 5]
    assert p.pick_decode("f", 1) == 0


def test_decode_retry_and_exclusion():
    p = policy(1, 2)
    assert p.pick_decode("a", 10) == 0
    assert p.pick_decode("a", 10, exclude={0}) == 1
    assert [d.in_flight for d in p.decode] == [0, 1]
    assert p.pick_decode("a", 10, exclude={0, 1}) is None
    p.set_decode_up(0, False)
    assert p.pick_decode("b", 1) == 1
    assert p.num_decode_up == 1
    p.finish_decode("a")
    p.finish_decode("b")
    p.finish_decode("b")  # twice: no effect
    assert [d.in_flight for d in p.decode] == [0, 0]


def test_parse_kv_events_from_json():
    h = hash_prompt_blocks(PROMPT, BS)[0]
    assert parse_kv_events([[1, h.hex()], [2, ""]]) == [(KV_STORED, h), (KV_CLEARED, b"")]
