"""The Prometheus logger: vLLM's metric names under `inferengine:`, the exact values after
feeding iteration, request and scheduler stats (counters moved by the core's cumulative totals,
never backwards), label sets, and histogram buckets."""

from __future__ import annotations

import pytest

from inferengine.core.engine_io import (
    KVTierStats,
    KVTransferStats,
    SchedulerStats,
    SpecDecodingStats,
)
from inferengine.metrics.prometheus import (
    FINISH_REASONS,
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    TTFT_BUCKETS,
    PrometheusStatLogger,
    buckets_1_2_5,
    iteration_buckets,
)
from inferengine.metrics.stats import FinishedRequestStats, IterationStats

M = {"model_name": "m"}


def logger(device: str = "cpu") -> PrometheusStatLogger:
    return PrometheusStatLogger("m", max_model_len=100, max_num_batched_tokens=300, device=device)


def value(log: PrometheusStatLogger, name: str, **labels) -> float | None:
    return log.registry.get_sample_value("inferengine:" + name, {**M, **labels})


def buckets(log: PrometheusStatLogger, name: str) -> dict[str, float]:
    """A histogram's cumulative bucket counts, by upper bound."""
    return {
        s.labels["le"]: s.value
        for family in log.registry.collect()
        if family.name == "inferengine:" + name
        for s in family.samples
        if s.name.endswith("_bucket")
    }


def finished(reason: str, e2e=1.2, queue=0.1, prefill=0.3, decode=0.8, prompt=12, gen=30):
    return FinishedRequestStats(reason, e2e, queue, prefill, decode, prompt, gen)


NAMES = {
    # gauges
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_leased_blocks",
    "kv_leased_cpu_pages", "kv_sessions", "kv_cpu_pages_used",
    # counters (exported with _total)
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
    "generation_tokens", "request_success", "kv_cpu_tier_hits", "kv_offloaded_blocks",
    "kv_loaded_blocks", "kv_offloaded_bytes", "kv_loaded_bytes", "kv_leased_evicted_blocks",
    "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos", "moe_expert_tokens",
    # histograms
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
    # disaggregated prefill/decode
    "kv_transfer_sent_tokens", "kv_transfer_received_tokens", "kv_transfer_local_prefill_tokens",
    "kv_transfer_fallback", "kv_transfer_expired_holds", "kv_transfer_held_blocks",
    "kv_transfer_waiting_requests", "kv_transfer_seconds", "kv_transfer_bytes",
    "lora_requests_info",
}  # fmt: skip


def test_the_metric_names():
    names = {family.name for family in logger().registry.collect()}
    assert names == {"inferengine:" + n for n in NAMES}
    cuda = {family.name for family in logger("cuda").registry.collect()}
    assert cuda - names == {"inferengine:gpu_memory_used_bytes"}


def test_a_fresh_logger_reads_zero_and_every_finish_reason_is_there():
    log = logger()
    assert value(log, "prompt_tokens_total") == 0
    assert value(log, "num_requests_running") == 0
    assert FINISH_REASONS == ("stop", "length", "abort")
    for reason in FINISH_REASONS:
        assert value(log, "request_success_total", finished_reason=reason) == 0
    assert value(log, "time_to_first_token_seconds_count") == 0


def test_iteration_tokens_and_latencies():
    log = logger()
    log.record(
        None,
        IterationStats(
            num_prompt_tokens=7,
            num_generation_tokens=3,
            time_to_first_tokens=[0.05, 0.3],
            inter_token_latencies=[0.02],
        ),
    )
    log.record(None, IterationStats(num_generation_tokens=2, inter_token_latencies=[0.2, 90.0]))
    assert value(log, "prompt_tokens_total") == 7
    assert value(log, "generation_tokens_total") == 5
    ttft = buckets(log, "time_to_first_token_seconds")
    assert (ttft["0.04"], ttft["0.06"], ttft["0.25"], ttft["0.5"], ttft["+Inf"]) == (0, 1, 1, 2, 2)
    assert value(log, "time_to_first_token_seconds_sum") == pytest.approx(0.35)
    itl = buckets(log, "inter_token_latency_seconds")
    assert (itl["0.01"], itl["0.025"], itl["0.2"], itl["80.0"], itl["+Inf"]) == (0, 1, 2, 2, 3)
    assert value(log, "inter_token_latency_seconds_count") == 3


def test_finished_requests_by_reason_with_their_times_and_token_counts():
    log = logger()
    log.record(
        None,
        IterationStats(
            finished=[finished("stop"), finished("length", e2e=3.0, prompt=60, gen=100)]
        ),
    )
    log.record(None, IterationStats(finished=[finished("abort", e2e=0.4, gen=0)]))
    assert value(log, "request_success_total", finished_reason="stop") == 1
    assert value(log, "request_success_total", finished_reason="length") == 1
    assert value(log, "request_success_total", finished_reason="abort") == 1
    e2e = buckets(log, "e2e_request_latency_seconds")
    assert (e2e["0.3"], e2e["0.5"], e2e["1.5"], e2e["5.0"]) == (0, 1, 2, 3)
    assert value(log, "e2e_request_latency_seconds_sum") == pytest.approx(4.6)
    assert value(log, "request_queue_time_seconds_sum") == pytest.approx(0.3)
    assert value(log, "request_prefill_time_seconds_count") == 3
    assert value(log, "request_decode_time_seconds_sum") == pytest.approx(2.4)
    # Token buckets 1, 2, 5, ... up to max_model_len (100).
    prompt = buckets(log, "request_prompt_tokens")
    assert list(prompt) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]
    assert (prompt["10.0"], prompt["20.0"], prompt["50.0"], prompt["100.0"]) == (0, 2, 2, 3)
    generation = buckets(log, "request_generation_tokens")
    assert (generation["1.0"], generation["50.0"], generation["100.0"]) == (1, 2, 3)
    # A reason outside the usual three gets its own label.
    log.record(None, IterationStats(finished=[finished("error")]))
    assert value(log, "request_success_total", finished_reason="error") == 1
    assert value(log, "request_success_total", finished_reason="stop") == 1


def test_scheduler_gauges_and_counters_from_cumulative_totals():
    log = logger()
    log.record(
        SchedulerStats(
            num_running=3,
            num_waiting=2,
            kv_cache_usage=0.25,
            prefix_cache_queries=100,
            prefix_cache_hits=40,
            num_preemptions=1,
            step_num_tokens=17,
        ),
        IterationStats(),
    )
    log.record(
        SchedulerStats(num_running=1, prefix_cache_queries=130, prefix_cache_hits=40),
        IterationStats(),
    )
    assert value(log, "num_requests_running") == 1 and value(log, "num_requests_waiting") == 0
    assert value(log, "kv_cache_usage_perc") == 0
    assert value(log, "prefix_cache_queries_total") == 130
    assert value(log, "prefix_cache_hits_total") == 40
    # Totals from an older snapshot arriving late move nothing back.
    log.record(SchedulerStats(prefix_cache_queries=120, num_preemptions=0), IterationStats())
    assert value(log, "prefix_cache_queries_total") == 130
    assert value(log, "num_preemptions_total") == 1
    # Only steps that scheduled tokens are observed; buckets end at the token budget.
    tokens = buckets(log, "iteration_tokens_total")
    assert list(tokens) == ["1.0", "8.0", "16.0", "32.0", "64.0", "128.0", "256.0", "300.0", "+Inf"]
    assert (tokens["16.0"], tokens["32.0"]) == (0, 1)
    assert value(log, "iteration_tokens_total_count") == 1
    assert value(log, "iteration_tokens_total_sum") == 17


def test_cpu_tier_and_session_stats():
    log = logger()
    tiers = KVTierStats(cpu_hit_tokens=64, offloaded_blocks=5, loaded_blocks=4,
                        offloaded_bytes=5 * 8192, loaded_bytes=4 * 8192, leased_blocks=3,
                        leased_cpu_pages=2, sessions=1, cpu_pages_used=9,
                        leased_evicted_blocks=1)  # fmt: skip
    log.record(SchedulerStats(kv_tiers=tiers), IterationStats())
    tiers = KVTierStats(cpu_hit_tokens=80, offloaded_blocks=5, loaded_blocks=6,
                        offloaded_bytes=5 * 8192, loaded_bytes=6 * 8192, sessions=0,
                        cpu_pages_used=7, leased_evicted_blocks=1)  # fmt: skip
    log.record(SchedulerStats(kv_tiers=tiers), IterationStats())
    assert value(log, "kv_cpu_tier_hits_total") == 80
    assert value(log, "kv_offloaded_blocks_total") == 5
    assert value(log, "kv_loaded_blocks_total") == 6
    assert value(log, "kv_offloaded_bytes_total") == 5 * 8192
    assert value(log, "kv_loaded_bytes_total") == 6 * 8192
    assert value(log, "kv_leased_evicted_blocks_total") == 1
    # Gauges: the newest snapshot.
    assert value(log, "kv_leased_blocks") == 0 and value(log, "kv_leased_cpu_pages") == 0
    assert value(log, "kv_sessions") == 0 and value(log, "kv_cpu_pages_used") == 7


def test_speculative_decoding_counters_by_position():
    log = logger()
    spec = SpecDecodingStats()
    spec.add(3, 2)
    spec.add(3, 0)
    log.record(SchedulerStats(spec_decoding=spec), IterationStats())
    spec.add(4, 4)
    log.record(SchedulerStats(spec_decoding=spec), IterationStats())
    assert value(log, "spec_decode_num_drafts_total") == 3
    assert value(log, "spec_decode_num_draft_tokens_total") == 10
    assert value(log, "spec_decode_num_accepted_tokens_total") == 6
    per_pos = [
        value(log, "spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(5)
    ]
    assert per_pos == [2, 2, 1, 1, None]  # position 4 was never drafted


def test_expert_token_counts_advance_per_layer_and_expert():
    log = logger()
    log.update_expert_token_counts({0: [3, 5], 1: [0, 2]})
    log.update_expert_token_counts({0: [4, 5], 1: [1, 2]})
    counts = {
        (layer, expert): value(log, "moe_expert_tokens_total", layer=str(layer), expert=str(expert))
        for layer in (0, 1)
        for expert in (0, 1)
    }
    assert counts == {(0, 0): 4, (0, 1): 5, (1, 0): 1, (1, 1): 2}


def test_gpu_memory_only_on_cuda():
    cpu, cuda = logger(), logger("cuda")
    cpu.set_gpu_memory_used(123)
    cuda.set_gpu_memory_used(2**30)
    assert value(cpu, "gpu_memory_used_bytes") is None
    assert value(cuda, "gpu_memory_used_bytes") == 2**30


def test_render_is_the_text_format_and_loggers_do_not_share_registries():
    one, two = logger(), logger()
    one.record(None, IterationStats(num_prompt_tokens=4, finished=[finished("abort")]))
    text = one.render().decode()
    assert "# TYPE inferengine:prompt_tokens_total counter" in text
    assert 'inferengine:prompt_tokens_total{model_name="m"} 4.0' in text
    assert 'inferengine:request_success_total{finished_reason="abort",model_name="m"} 1.0' in text
    assert "# TYPE inferengine:time_to_first_token_seconds histogram" in text
    assert value(two, "prompt_tokens_total") == 0


def test_bucket_helpers():
    assert buckets_1_2_5(100) == [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
    assert buckets_1_2_5(7) == [1.0, 2.0, 5.0]
    assert buckets_1_2_5(4096)[-3:] == [500.0, 1000.0, 2000.0]
    assert buckets_1_2_5(0) == []
    assert iteration_buckets(8) == [1.0, 8.0]
    assert iteration_buckets(2048) == [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
                                       2048.0]  # fmt: skip
    assert iteration_buckets(100000)[-2:] == [16384.0, 100000.0]
    # vLLM's bucket bounds.
    assert TTFT_BUCKETS[0] == 0.001 and TTFT_BUCKETS[-1] == 2560.0 and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0 and len(ITL_BUCKETS) == 19
    assert LATENCY_BUCKETS[0] == 0.3 and LATENCY_BUCKETS[-1] == 7680.0
    for bounds in (TTFT_BUCKETS, ITL_BUCKETS, LATENCY_BUCKETS):
        assert bounds == sorted(set(bounds))


def test_kv_transfer_counters_advance_and_each_fetch_is_observed_once():
    log = logger()
    first = KVTransferStats(
        received_tokens=64, fallbacks=1, held_blocks=3, recent=[(1, 0.02, 4096)]
    )
    log.update_scheduler_stats(SchedulerStats(kv_transfer=first))
    later = KVTransferStats(
        received_tokens=96, fallbacks=1, recent=[(1, 0.02, 4096), (2, 3.0, 2**20)]
    )
    log.update_scheduler_stats(SchedulerStats(kv_transfer=later))
    log.update_scheduler_stats(SchedulerStats(kv_transfer=later))  # a refresh: nothing new
    assert value(log, "kv_transfer_received_tokens_total") == 96
    assert value(log, "kv_transfer_fallback_total") == 1
    assert value(log, "kv_transfer_held_blocks") == 0
    seconds = buckets(log, "kv_transfer_seconds")
    assert (seconds["0.025"], seconds["5.0"], seconds["+Inf"]) == (1, 2, 2)
    assert value(log, "kv_transfer_bytes_sum") == 4096 + 2**20
