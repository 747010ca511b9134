"""The scheduler's half of disaggregated prefill/decode, with exact page ids: what a producer
publishes and holds, what a consumer fetches and into which pages, and what a failure frees."""

from __future__ import annotations

from inferengine.config import CacheConfig, KVTransferConfig, SchedulerConfig
from inferengine.core.request import RequestStatus
from inferengine.core.sched_output import KVTransferEvents, ModelRunnerOutput
from inferengine.core.scheduler import Scheduler
from tests.core.helpers import check_manager, fake_runner_output, make_request

BLOCK = 16


def scheduler(role: str, num_blocks: int = 32, **transfer) -> Scheduler:
    config = KVTransferConfig(kv_role=role, engine_id="e1", **transfer)
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=512),
        CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        kv_transfer_config=config,
    )


def run(sched: Scheduler, events: KVTransferEvents | None = None):
    out = sched.schedule()
    runner = fake_runner_output(sched, out, lambda _r: 7)
    runner.kv_events = events
    return out, sched.update_from_output(out, runner)


def test_a_producer_publishes_the_full_prompt_pages_and_holds_them_until_released():
    sched = scheduler("kv_producer")
    request = make_request("p", list(range(40)), max_tokens=1)  # 2 full pages and 8 tokens
    request.kv_transfer_params = {"do_remote_decode": True}
    sched.add_request(request)
    out = sched.schedule()
    assert out.kv_publishes == {"p": [1, 2]}
    runner = fake_runner_output(sched, out, lambda _r: 7)
    runner.kv_events = KVTransferEvents(published={"p": {"transport": "T", "x": 1}})
    (output,) = sched.update_from_output(out, runner).outputs
    params = output.kv_transfer_params
    assert params["remote_block_ids"] == [1, 2] and params["num_tokens"] == 32
    assert (params["do_remote_prefill"], params["remote_request_id"], params["x"]) == (True, "p", 1)
    assert params["remote_engine_id"] == "e1" and params["transport"] == "T"
    kv = sched.kv_cache_manager
    assert [b.ref_cnt for b in kv.pool.blocks[1:4]] == [1, 1, 0]  # held; the partial page freed
    assert sched.make_stats().kv_transfer.held_blocks == 2
    assert not sched.has_unfinished_requests()  # a hold keeps no step loop busy
    run(sched, KVTransferEvents(released=["p"]))  # the consumer took them
    assert [b.ref_cnt for b in kv.pool.blocks[1:3]] == [0, 0]
    stats = sched.make_stats().kv_transfer
    assert (stats.sent_tokens, stats.sent_transfers, stats.held_blocks) == (32, 1, 0)


def test_a_hold_no_consumer_takes_is_freed_after_the_timeout():
    sched = scheduler("kv_producer", kv_hold_timeout_s=5)
    now = [100.0]
    sched.kv_connector.clock = lambda: now[0]
    request = make_request("p", list(range(33)), max_tokens=1)
    request.kv_transfer_params = {"do_remote_decode": True}
    sched.add_request(request)
    run(sched, KVTransferEvents(published={"p": {}}))
    assert sched.make_stats().kv_transfer.held_blocks == 2
    now[0] = 104.0
    sched.schedule()
    assert sched.make_stats().kv_transfer.held_blocks == 2
    now[0] = 105.0
    sched.schedule()
    stats = sched.make_stats().kv_transfer
    assert (stats.held_blocks, stats.expired_holds, stats.sent_tokens) == (0, 1, 0)
    check_manager(sched.kv_cache_manager)


def test_pages_pushed_before_the_request_ends_are_not_held():
    sched = scheduler("kv_producer")
    request = make_request("p", list(range(40)), max_tokens=1)
    request.kv_transfer_params = {"do_remote_decode": True}
    sched.add_request(request)
    _, outputs = run(sched, KVTransferEvents(published={"p": {"shm_path": "f"}}, released=["p"]))
    assert outputs.outputs[0].kv_transfer_params["shm_path"] == "f"
    stats = sched.make_stats().kv_transfer
    assert (stats.held_blocks, stats.sent_tokens) == (0, 32)
    check_manager(sched.kv_cache_manager)


def producer_params(block_ids: list[int], **extra) -> dict:
    return {
        "do_remote_prefill": True,
        "remote_request_id": "p",
        "remote_block_ids": block_ids,
        "block_size": BLOCK,
        **extra,
    }


def test_a_consumer_fetches_all_but_the_last_page_into_pages_allocated_ahead():
    sched = scheduler("kv_consumer")
    request = make_request("c", list(range(48)), max_tokens=3)  # 3 full pages: fetch 2
    request.kv_transfer_params = producer_params([11, 12, 13])
    sched.add_request(request)
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 0
    (fetch,) = out.kv_fetches
    assert (fetch.req_id, fetch.remote_block_ids, fetch.block_ids) == ("c", [11, 12], [1, 2])
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV
    assert sched.has_unfinished_requests() and sched.make_stats().kv_transfer.waiting_requests == 1
    kv = sched.kv_cache_manager
    assert kv.pool.blocks[1].block_hash is None  # not findable before its bytes arrive
    out, _ = run(sched, KVTransferEvents(fetched={"c": (True, 0.01, 2048)}))
    assert out.total_num_scheduled_tokens == 0  # the verdict comes with this step's output
    out, _ = run(sched)
    assert out.num_scheduled_tokens == {"c": 16}  # the last page only
    assert out.scheduled_new_reqs[0].block_ids == [1, 2, 3]
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert kv.pool.blocks[1].block_hash is not None  # registered once filled
    stats = sched.make_stats().kv_transfer
    assert (stats.received_tokens, stats.local_prefill_tokens, stats.fallbacks) == (32, 16, 0)
    assert stats.recent == [(1, 0.01, 2048)] and stats.waiting_requests == 0
    assert request.num_cached_tokens == 32


def test_local_prefix_hits_are_not_fetched_again():
    sched = scheduler("kv_consumer")
    prompt = list(range(50))
    sched.add_request(make_request("warm", prompt[:33], max_tokens=1))
    run(sched)  # pages 1, 2 now cache the first two pages of the prompt
    request = make_request("c", prompt, max_tokens=1)
    request.kv_transfer_params = producer_params([21, 22, 23])
    sched.add_request(request)
    out = sched.schedule()
    (fetch,) = out.kv_fetches
    assert (fetch.remote_block_ids, fetch.block_ids) == ([23], [3])  # page 3: warm's partial one
    assert request.num_computed_tokens == 32


def test_a_failed_fetch_frees_its_pages_and_the_prompt_is_computed():
    sched = scheduler("kv_consumer")
    request = make_request("c", list(range(40)), max_tokens=2)
    request.kv_transfer_params = producer_params([5, 6])
    sched.add_request(request)
    out = sched.schedule()
    assert out.kv_fetches[0].block_ids == [1, 2]
    run(sched, KVTransferEvents(fetched={"c": (False, 30.0, 0)}))
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
    check_manager(sched.kv_cache_manager)
    out, _ = run(sched)
    assert out.num_scheduled_tokens == {"c": 40} and not out.kv_fetches  # never fetched again
    stats = sched.make_stats().kv_transfer
    assert (stats.fallbacks, stats.received_tokens, stats.local_prefill_tokens) == (1, 0, 40)


def test_unusable_params_run_the_request_plainly_and_count_a_fallback():
    sched = scheduler("kv_consumer")
    for i, params in enumerate(
        [
            producer_params("not a list"),
            producer_params([1], block_size=32),
            producer_params([1], expires_at=0.0),
        ]
    ):
        request = make_request(f"c{i}", list(range(100 * i, 100 * i + 40)), max_tokens=1)
        request.kv_transfer_params = params
        sched.add_request(request)
    out = sched.schedule()
    assert not out.kv_fetches and sum(out.num_scheduled_tokens.values()) == 120
    assert sched.make_stats().kv_transfer.fallbacks == 3


def test_an_abort_while_fetching_frees_the_pages_only_after_the_worker_is_done():
    sched = scheduler("kv_consumer")
    request = make_request("c", list(range(40)), max_tokens=2)
    request.kv_transfer_params = producer_params([5, 6])
    sched.add_request(request)
    sched.schedule()
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    kv = sched.kv_cache_manager
    assert kv.get_block_ids("c") == [1, 2]  # a fetch may still write them
    run(sched, KVTransferEvents(fetched={"c": (True, 0.1, 100)}))
    assert kv.get_block_ids("c") == [] and "c" not in sched.requests
    assert not sched.has_unfinished_requests()
    check_manager(kv)


def test_without_a_config_nothing_changes():
    plain = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=512),
        CacheConfig(block_size=BLOCK, num_blocks=32),
    )
    request = make_request("r", list(range(40)), max_tokens=1)
    request.kv_transfer_params = {"do_remote_decode": True, **producer_params([1, 2])}
    plain.add_request(request)
    out = plain.schedule()
    assert (out.kv_fetches, out.kv_publishes, out.num_scheduled_tokens) == ([], {}, {"r": 40})
    runner = fake_runner_output(plain, out, lambda _r: 7)
    assert isinstance(runner, ModelRunnerOutput)
    (output,) = plain.update_from_output(out, runner).outputs
    assert output.kv_transfer_params is None and plain.make_stats().kv_transfer is None
