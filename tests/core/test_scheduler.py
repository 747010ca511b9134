"""Scheduler: token budget, chunked prefill, preemption, priorities, aborts and stop conditions."""

from __future__ import annotations

from inferengine.core.request import FinishReason, RequestStatus
from inferengine.core.sched_output import ModelRunnerOutput
from tests.core.helpers import EOS, check_manager, make_request, make_scheduler, step


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def scheduled(output) -> dict[str, int]:
    return dict(output.num_scheduled_tokens)


def new_block_ids(output) -> dict[str, list[int]]:
    return {c.req_id: c.new_block_ids for c in output.scheduled_cached_reqs}


def test_one_request_prefill_then_decode_with_exact_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(40), max_tokens=10))
    out, _ = step(sched)
    assert scheduled(out) == {"a": 40} and out.total_num_scheduled_tokens == 40
    (new,) = out.scheduled_new_reqs
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("a", [1, 2, 3], 0)
    assert new.output_token_ids == []
    for _ in range(8):  # tokens 41..48 fit block 3
        out, _ = step(sched)
        assert scheduled(out) == {"a": 1} and new_block_ids(out) == {"a": []}
    out, _ = step(sched)  # token 49 needs block 4
    assert new_block_ids(out) == {"a": [4]}
    assert out.scheduled_cached_reqs[0].num_computed_tokens == 48
    check_manager(sched.kv_cache_manager)


def test_running_requests_get_the_budget_first_then_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=32)
    sched.add_request(make_request("a", prompt(10)))
    step(sched)
    sched.add_request(make_request("b", prompt(50, 500)))
    sched.add_request(make_request("c", prompt(5, 900)))
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1, "b": 31}
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1, "b": 19, "c": 5}
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1, "b": 1, "c": 1}


def test_chunked_prefill_splits_a_long_prompt_and_samples_after_the_last_chunk():
    sched = make_scheduler(max_num_batched_tokens=32)
    request = make_request("a", prompt(100))
    sched.add_request(request)
    chunks = []
    for _ in range(4):
        out, engine_out = step(sched)
        chunks.append(scheduled(out)["a"])
        if len(chunks) < 4:
            assert engine_out.outputs == [] and request.num_output_tokens == 0
    assert chunks == [32, 32, 32, 4]
    assert [o.new_token_ids for o in engine_out.outputs] == [[7]]
    assert request.num_computed_tokens == 100 and request.num_tokens == 101
    assert sched.kv_cache_manager.get_block_ids("a") == list(range(1, 8))


def test_long_prefill_threshold_caps_each_requests_chunk():
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=20)
    sched.add_request(make_request("a", prompt(50)))
    sched.add_request(make_request("b", prompt(50, 500)))
    sizes = [scheduled(step(sched)[0]) for _ in range(4)]
    assert sizes == [
        {"a": 20, "b": 20},
        {"a": 20, "b": 20},
        {"a": 10, "b": 10},
        {"a": 1, "b": 1},
    ]


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", prompt(4, 100 * i), max_tokens=2))
    out, _ = step(sched)
    assert scheduled(out) == {"r0": 4, "r1": 4} and len(sched.running) == 2
    out, engine_out = step(sched)  # r0 and r1 reach max_tokens
    assert scheduled(out) == {"r0": 1, "r1": 1}
    assert {o.request_id: o.finish_reason for o in engine_out.outputs} == {
        "r0": FinishReason.LENGTH,
        "r1": FinishReason.LENGTH,
    }
    out, _ = step(sched)
    assert scheduled(out) == {"r2": 4} and out.finished_req_ids == {"r0", "r1"}


def test_fcfs_preempts_the_last_running_request_and_resumes_it_later():
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=64)  # 4 usable blocks
    a = make_request("a", prompt(31), max_tokens=4)
    b = make_request("b", prompt(31, 500), max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[1, 2], [3, 4]]
    step(sched)  # token 32 fills block 2 and block 4
    b_tokens = list(b.output_token_ids)
    sched.add_request(make_request("c", [1]))  # would fit, but not in a step that preempted
    out, _ = step(sched)
    # a needs a third block: b (the last running) is preempted, and a takes b's last block.
    assert scheduled(out) == {"a": 1} and new_block_ids(out) == {"a": [4]}
    assert out.finished_req_ids == {"b"} and out.scheduled_new_reqs == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.num_preemptions == 1 and b.num_preemptions == 1
    check_manager(sched.kv_cache_manager)
    out, engine_out = step(sched)  # a finishes; b cannot fit next to it yet
    assert scheduled(out) == {"a": 1}
    assert engine_out.outputs[0].finish_reason == FinishReason.LENGTH
    # Free list now: 4 (a's partial block) first, then b's cached block 3, then a's 2 and 1.
    out, _ = step(sched)
    (new_b, new_c) = out.scheduled_new_reqs
    assert new_b.req_id == "b" and new_b.output_token_ids == b_tokens == [7, 7]
    assert new_b.num_computed_tokens == 16  # b's first block survived in the cache
    assert new_b.block_ids == [3, 4, 2]
    assert scheduled(out) == {"b": 17, "c": 1}
    assert new_c.block_ids == [1]
    assert b.num_cached_tokens == 0  # the hit at first scheduling, not at resumption
    check_manager(sched.kv_cache_manager)


def test_priority_preempts_the_largest_priority_even_if_already_scheduled():
    sched = make_scheduler(num_blocks=4, policy="priority")  # 3 usable blocks
    low = make_request("low", prompt(20), priority=1, arrival_time=0.0)
    sched.add_request(low)
    step(sched)  # low: blocks 1, 2
    high = make_request("high", prompt(16, 500), priority=0, arrival_time=1.0)
    sched.add_request(high)
    out, _ = step(sched)  # low decodes, high gets block 3
    assert scheduled(out) == {"low": 1, "high": 16}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["high"]
    out, _ = step(sched)
    # low was scheduled first in this step; high then needs a block, so low is preempted,
    # its token goes back into the budget, and high gets low's unhashed block 2.
    assert scheduled(out) == {"high": 1} and out.total_num_scheduled_tokens == 1
    assert new_block_ids(out) == {"high": [2]}
    assert out.finished_req_ids == {"low"}
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert sched.kv_cache_manager.pool.get_cached_block(low.block_hashes[0]).block_id == 1
    check_manager(sched.kv_cache_manager)


def test_a_victim_scheduled_in_the_same_step_loses_the_hashes_of_its_uncomputed_blocks():
    sched = make_scheduler(
        num_blocks=8,
        max_num_batched_tokens=49,
        long_prefill_token_threshold=33,
        policy="priority",
    )
    low = make_request("low", prompt(90), priority=1, arrival_time=0.0)
    sched.add_request(low)
    step(sched)  # low: tokens 0..32 in blocks 1, 2, 3
    sched.add_request(make_request("high", prompt(16, 500), priority=0, arrival_time=1.0))
    out, _ = step(sched)
    assert scheduled(out) == {"low": 33, "high": 16}
    assert new_block_ids(out) == {"low": [4, 5]} and out.scheduled_new_reqs[0].block_ids == [6]
    out, _ = step(sched)
    # low's last chunk (66..89) registers block 5 and takes block 7; then high needs a block
    # and none is free, so low is preempted before computing that chunk. Block 5 loses its
    # hash and goes to the front with 7: high gets it, and no later request can hit it.
    assert scheduled(out) == {"high": 1} and new_block_ids(out) == {"high": [5]}
    assert out.finished_req_ids == {"low"}
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    pool = sched.kv_cache_manager.pool
    assert [b.block_id for b in pool.free_queue] == [7, 4, 3, 2, 1]
    assert low.block_hashes[4] not in pool.cached
    again = make_request("again", prompt(90), block_size=16)
    hits, num_hit_tokens = sched.kv_cache_manager.get_computed_blocks(again)
    assert [b.block_id for b in hits] == [1, 2, 3, 4] and num_hit_tokens == 64
    check_manager(sched.kv_cache_manager)


def test_priority_admits_lower_priority_values_first():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    sched.add_request(make_request("late", prompt(4), max_tokens=1, priority=5, arrival_time=0))
    sched.add_request(make_request("b", prompt(4), max_tokens=1, priority=1, arrival_time=2))
    sched.add_request(make_request("a", prompt(4), max_tokens=1, priority=1, arrival_time=1))
    order = [next(iter(scheduled(step(sched)[0]))) for _ in range(3)]
    assert order == ["a", "b", "late"]


def test_fcfs_admits_in_arrival_order_whatever_the_priority():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("x", prompt(4), max_tokens=1, priority=5))
    sched.add_request(make_request("y", prompt(4), max_tokens=1, priority=0))
    assert [next(iter(scheduled(step(sched)[0]))) for _ in range(2)] == ["x", "y"]


def test_aborting_waiting_and_running_requests_frees_their_pages():
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    sched.add_request(make_request("run", prompt(40)))
    sched.add_request(make_request("wait", prompt(8, 500)))
    step(sched)
    assert sched.kv_cache_manager.pool.num_free_blocks == 6
    aborted = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in aborted] == ["run", "wait"]
    assert all(r.finish_reason == FinishReason.ABORT for r in aborted)
    assert not sched.has_unfinished_requests() and sched.requests == {}
    assert sched.kv_cache_manager.pool.num_free_blocks == 9
    assert sched.kv_cache_manager.req_to_blocks == {}
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"run", "wait"}
    assert sched.schedule().finished_req_ids == set()
    check_manager(sched.kv_cache_manager)


def test_abort_between_schedule_and_update_is_ignored_by_update():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(4)))
    out = sched.schedule()
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    runner = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]])
    assert sched.update_from_output(out, runner).outputs == []


def run_one(tokens: list[int], **params):
    """Feed `tokens` one per step to a fresh request; returns (request, engine outputs)."""
    sched = make_scheduler(max_model_len=params.pop("max_model_len", 1024))
    request = make_request("r", prompt(4), **params)
    sched.add_request(request)
    outputs = []
    for token in tokens:
        _, engine_out = step(sched, token)
        outputs.extend(engine_out.outputs)
        if request.is_finished:
            break
    return request, outputs, sched


def test_eos_stops_unless_ignore_eos():
    request, outputs, sched = run_one([5, EOS, 6])
    assert request.output_token_ids == [5, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].new_token_ids == [EOS]
    assert sched.kv_cache_manager.pool.num_free_blocks == 63 and "r" not in sched.requests
    request, _, _ = run_one([5, EOS, 6], ignore_eos=True, max_tokens=3)
    assert request.output_token_ids == [5, EOS, 6]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_ids_stop_with_the_token_as_stop_reason():
    request, outputs, _ = run_one([5, 9, 6], stop_token_ids=[9])
    assert request.output_token_ids == [5, 9] and request.stop_reason == 9
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (FinishReason.STOP, 9)


def test_max_tokens_and_max_model_len_cap_the_length():
    request, outputs, _ = run_one([5] * 10, max_tokens=3)
    assert request.output_token_ids == [5, 5, 5]
    assert outputs[-1].finish_reason == FinishReason.LENGTH
    request, _, _ = run_one([5] * 10, max_tokens=None, max_model_len=7)
    assert request.num_tokens == 7 and request.output_token_ids == [5, 5, 5]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_eos_before_min_tokens_does_not_stop():
    request, _, _ = run_one([EOS, 9, EOS, EOS], min_tokens=3, stop_token_ids=[9])
    assert request.output_token_ids == [EOS, 9, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None


def test_several_tokens_in_one_step_stop_at_the_first_stop_token():
    sched = make_scheduler()
    request = make_request("r", prompt(4))
    sched.add_request(request)
    out = sched.schedule()
    runner = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[5, EOS, 6]])
    (engine_out,) = sched.update_from_output(out, runner).outputs
    assert engine_out.new_token_ids == [5, EOS] and request.output_token_ids == [5, EOS]
    assert engine_out.finish_reason == FinishReason.STOP


def test_finished_ids_reach_the_next_scheduler_output():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(4), max_tokens=1))
    sched.add_request(make_request("b", prompt(4, 500), max_tokens=2))
    out, _ = step(sched)
    assert out.finished_req_ids == set()
    out, _ = step(sched)
    assert out.finished_req_ids == {"a"} and scheduled(out) == {"b": 1}
    out, _ = step(sched)
    assert out.finished_req_ids == {"b"} and out.is_empty


def test_num_cached_tokens_is_the_prefix_hit_at_first_scheduling():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(40), max_tokens=1))
    _, engine_out = step(sched)
    assert engine_out.outputs[0].num_cached_tokens == 0
    b = make_request("b", [*prompt(32), *prompt(8, 900)], max_tokens=1)
    sched.add_request(b)
    out, engine_out = step(sched)
    # a's unhashed last block 3 went to the front of the free list: b reuses it first.
    assert scheduled(out) == {"b": 8} and out.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    assert b.num_cached_tokens == 32 and engine_out.outputs[0].num_cached_tokens == 32
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)


def test_same_prompt_in_one_step_hits_blocks_allocated_in_that_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(40)))
    sched.add_request(make_request("b", prompt(40)))
    out, _ = step(sched)
    assert scheduled(out) == {"a": 40, "b": 8}
    blocks = {r.req_id: (r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs}
    assert blocks == {"a": ([1, 2, 3], 0), "b": ([1, 2, 4], 32)}
    assert [sched.kv_cache_manager.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    check_manager(sched.kv_cache_manager)


def test_without_prefix_caching_nothing_is_shared():
    sched = make_scheduler(enable_prefix_caching=False)
    sched.add_request(make_request("a", prompt(40)))
    sched.add_request(make_request("b", prompt(40)))
    out, _ = step(sched)
    assert scheduled(out) == {"a": 40, "b": 40}
    assert [r.block_ids for r in out.scheduled_new_reqs] == [[1, 2, 3], [4, 5, 6]]


def test_duplicate_request_id_is_refused():
    sched = make_scheduler()
    sched.add_request(make_request("a", prompt(4)))
    try:
        sched.add_request(make_request("a", prompt(4)))
    except ValueError as error:
        assert "already in use" in str(error)
    else:
        raise AssertionError("a duplicate id was accepted")


def test_async_scheduling_counts_tokens_in_flight_and_stops_at_max_tokens():
    sched = make_scheduler()
    request = make_request("r", prompt(4), max_tokens=2)
    sched.add_request(request)
    first = sched.schedule()
    assert scheduled(first) == {"r": 4} and request.num_output_placeholders == 1
    # Step 2 is scheduled before step 1's token is known: it decodes that token.
    second = sched.schedule()
    assert scheduled(second) == {"r": 1} and request.num_output_placeholders == 2
    runner = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[7]])
    sched.update_from_output(first, runner)
    assert request.output_token_ids == [7] and request.num_output_placeholders == 1
    # The second (last) token is on its way: nothing more to schedule.
    assert sched.schedule().is_empty
    runner = ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[8]])
    (out,) = sched.update_from_output(second, runner).outputs
    assert out.new_token_ids == [8] and out.finish_reason == FinishReason.LENGTH
    assert request.output_token_ids == [7, 8]
    assert sched.schedule().finished_req_ids == {"r"}
    assert sched.kv_cache_manager.pool.num_free_blocks == 63


def test_async_scheduling_stops_at_max_model_len_without_a_wasted_step():
    sched = make_scheduler(max_model_len=6)
    request = make_request("r", prompt(4), max_tokens=None)
    sched.add_request(request)
    first = sched.schedule()
    second = sched.schedule()  # decodes the token step 1 samples (position 4)
    assert scheduled(second) == {"r": 1}
    sched.update_from_output(first, ModelRunnerOutput(["r"], [[7]]))
    assert sched.schedule().is_empty  # token 6 of 6 is on its way
    (out,) = sched.update_from_output(second, ModelRunnerOutput(["r"], [[8]])).outputs
    assert out.finish_reason == FinishReason.LENGTH and request.num_tokens == 6
