"""Statistics of a benchmark run on hand-made request outputs with known answers."""

from __future__ import annotations

import pytest

from inferengine.bench.client import RequestOutput
from inferengine.bench.config import WorkloadConfig, percentile_label
from inferengine.bench.metrics import build_metrics, format_summary, peak_rates, summarize_ms


def ok(start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10) -> RequestOutput:
    return RequestOutput(
        success=True,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        output_tokens=tokens,
        prompt_len=prompt,
        usage_reported=True,
        generated_text="x" * tokens,
    )


def test_summary_of_known_values():
    # 1..5 s: mean 3, median 3, population std sqrt(2); p99 by linear interpolation
    # between the 4th and 5th values: 4 + 0.96 * (5 - 4) = 4.96.
    stats = summarize_ms([1.0, 2.0, 3.0, 4.0, 5.0], [50, 90, 99, 99.9])
    assert stats["mean"] == pytest.approx(3000.0)
    assert stats["median"] == pytest.approx(3000.0)
    assert stats["std"] == pytest.approx(2**0.5 * 1000.0)
    assert stats["p50"] == pytest.approx(3000.0)
    assert stats["p90"] == pytest.approx(4600.0)
    assert stats["p99"] == pytest.approx(4960.0)
    assert stats["p99.9"] == pytest.approx(4996.0)


def test_summary_of_nothing_is_zeros():
    assert summarize_ms([], [99]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p99": 0.0}


def test_percentile_labels():
    assert percentile_label(99) == "99"
    assert percentile_label(99.0) == "99"
    assert percentile_label(99.9) == "99.9"


def test_metrics_of_a_small_run():
    outputs = [
        ok(0.0, 0.10, [0.02, 0.02, 0.02], tokens=4),  # tpot (0.16 - 0.10) / 3 = 0.02
        ok(0.5, 0.20, [0.05], tokens=4),  # several tokens in one chunk: tpot 0.05 / 3
        ok(1.0, 0.30, [], tokens=1),  # one token: no TPOT
        RequestOutput(success=False, error="HTTP 500", prompt_len=7),
    ]
    w = WorkloadConfig(percentile_metrics=("ttft", "tpot", "itl", "e2el"), metric_percentiles=(50,))
    m = build_metrics(outputs, 2.0, w, [10, 10, 10, 7], [4, 4, 1, 4], [0.0, 0.5, 1.0, 1.5])
    assert (m["completed"], m["failed"]) == (3, 1)
    assert m["total_input_tokens"] == 30  # failed requests do not count
    assert m["total_output_tokens"] == 9
    assert m["output_lens"] == [4, 4, 1, 0]
    assert m["input_lens"] == [10, 10, 10, 7]
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(19.5)
    assert m["request_goodput"] is None
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx((20.0 + 50.0 / 3) / 2)
    assert m["median_itl_ms"] == pytest.approx(20.0)  # gaps 20, 20, 20, 50
    assert m["mean_itl_ms"] == pytest.approx(27.5)
    assert m["p50_e2el_ms"] == pytest.approx(250.0)  # 160, 250, 300
    assert m["errors"] == ["", "", "", "HTTP 500"]
    assert m["ttfts"][3] == 0.0 and m["itls"][3] == []


def test_goodput_counts_requests_within_every_slo():
    outputs = [ok(0.0, 0.1, [0.01] * 3, 4), ok(0.0, 0.5, [0.01] * 3, 4), ok(0.0, 0.1, [0.1] * 3, 4)]
    w = WorkloadConfig(goodput={"ttft": 200.0, "tpot": 50.0})
    m = build_metrics(outputs, 2.0, w, [1] * 3, [4] * 3, [0.0] * 3)
    assert m["request_goodput"] == pytest.approx(0.5)  # only the first meets both


def test_peak_rates_count_chunks_and_active_requests_per_second():
    outputs = [
        ok(0.0, 0.1, [0.1] * 5, 6),  # chunks at 0.1..0.6 s: all in second 0
        ok(0.2, 0.1, [0.5, 0.5], 3),  # chunks at 0.3, 0.8, 1.3
        ok(1.5, 0.1, [], 1),  # a chunk at 1.6
    ]
    peak_tokens, peak_active = peak_rates(outputs)
    assert peak_tokens == 8.0  # second 0: 6 + 2
    assert peak_active == 2


def test_summary_table_has_vllm_rows():
    w = WorkloadConfig(max_concurrency=4)
    m = build_metrics([ok(0.0, 0.1, [0.01], 2)], 1.0, w, [10], [2], [0.0])
    text = format_summary(m, w)
    for line in (
        "Serving Benchmark Result",
        "Successful requests:",
        "Maximum request concurrency:",
        "Output token throughput (tok/s):",
        "Median TTFT (ms):",
        "P99 ITL (ms):",
        "Mean E2EL (ms):",
    ):
        assert line in text
