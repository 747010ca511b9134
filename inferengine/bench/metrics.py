"""Benchmark statistics under vLLM's result field names, and the summary table it prints."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from inferengine.bench.client import RequestOutput
from inferengine.bench.config import WorkloadConfig, percentile_label

METRIC_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def summarize_ms(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """Mean, median, population std and percentiles (linear interpolation) in milliseconds.

    An empty list summarizes as zeros, as in vLLM.
    """
    ms = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    stats = {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "std": float(ms.std()),
    }
    for p in percentiles:
        stats[f"p{percentile_label(p)}"] = float(np.percentile(ms, p))
    return stats


def peak_rates(outputs: Sequence[RequestOutput]) -> tuple[float, int]:
    """Most text chunks received in one second, and most requests active in one second.

    As vLLM 0.26: one-second buckets from the first request's start; a chunk counts once.
    """
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0, 0
    t0 = min(o.start_time for o in done)
    t_end = max(o.start_time + o.latency for o in done)
    num_buckets = math.ceil(t_end - t0) + 1
    tokens = np.zeros(num_buckets)
    active = np.zeros(num_buckets)
    for o in done:
        times = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        buckets = (times - t0).astype(np.int64)
        np.add.at(tokens, buckets[(buckets >= 0) & (buckets < num_buckets)], 1)
        first = int(o.start_time - t0)
        last = min(int(o.start_time + o.latency - t0), num_buckets - 1)
        active[first : last + 1] += 1
    return float(tokens.max()), int(active.max())


def build_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    workload: WorkloadConfig,
    expected_input_lens: Sequence[int],
    expected_output_lens: Sequence[int],
    start_times: Sequence[float],
) -> dict:
    """The result fields from `duration` on, in the order vLLM writes them."""
    output_lens: list[int] = []
    ttfts, tpots, all_tpots, itls, e2els = [], [], [], [], []
    total_input = 0
    for o in outputs:
        if not o.success:
            output_lens.append(0)
            continue
        output_lens.append(o.output_tokens)
        total_input += o.prompt_len
        tpot = 0.0
        if o.output_tokens > 1:
            tpot = (o.latency - o.ttft) / (o.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls += o.itl
        ttfts.append(o.ttft)
        e2els.append(o.latency)
    completed = len(ttfts)
    total_output = sum(output_lens)
    goodput = None
    if workload.goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = sum(
            all(per_metric[k][i] * 1000.0 <= slo for k, slo in workload.goodput.items())
            for i in range(completed)
        )
        goodput = good / duration_s
    max_tokens_per_s, max_concurrent = peak_rates(outputs)
    usage_missing = sum(o.success and not o.usage_reported for o in outputs)
    result = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": goodput,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "start_times": list(start_times),
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_concurrent,
        "rtfx": 0.0,
        # Ours, beyond vLLM's fields:
        "latencies": [o.latency for o in outputs],
        "expected_input_lens": list(expected_input_lens),
        "expected_output_lens": list(expected_output_lens),
        "output_lens_source": "usage" if usage_missing == 0 else "text chunks (no usage)",
        "num_requests_without_usage": usage_missing,
    }
    series = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for name in workload.percentile_metrics:
        for stat, value in summarize_ms(series[name], workload.metric_percentiles).items():
            result[f"{stat}_{name}_ms"] = value
    return result


def format_summary(result: dict, workload: WorkloadConfig) -> str:
    """The table vLLM prints at the end of a run."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name: str, value: object, fmt: str = "") -> None:
        lines.append(f"{name:<40} {value:<10{fmt}}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if workload.max_concurrency is not None:
        row("Maximum request concurrency:", workload.max_concurrency)
    if workload.request_rate != math.inf:
        row("Request rate configured (RPS):", workload.request_rate, ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", float(result["max_concurrent_requests"]), ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name in workload.percentile_metrics:
        short, header = METRIC_HEADERS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in workload.metric_percentiles:
            label = percentile_label(p)
            row(f"P{label} {short} (ms):", result[f"p{label}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)
