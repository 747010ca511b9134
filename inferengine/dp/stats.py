"""Scheduler stats over several replicas: summed, with the counts of replicas that restarted kept.

A replica that restarts starts its cumulative counts (prefix-cache queries and hits,
preemptions, ...) from zero; its last counts join a `retired` total so the sums never go back.
"""

from __future__ import annotations

from typing import Any

import msgspec

from inferengine.core.engine_io import SchedulerStats

# Fields that describe the present (summed over the live replicas only), not a running count.
GAUGES = {
    "num_running",
    "num_waiting",
    "kv_cache_usage",
    "num_blocks",
    "num_free_blocks",
    "num_cached_free_blocks",
    "step_num_tokens",
    "cpu_pages_total",
    "cpu_pages_used",
    "leased_blocks",
    "leased_cpu_pages",
    "sessions",
}


def _add(into: dict[str, Any], other: dict[str, Any], skip_gauges: bool) -> None:
    for key, value in other.items():
        if skip_gauges and key in GAUGES:
            continue
        if isinstance(value, dict):
            _add(into.setdefault(key, {}), value, skip_gauges)
        elif isinstance(value, list):
            old = into.get(key) or []
            longer = max(len(old), len(value))
            old, value = old + [0] * (longer - len(old)), value + [0] * (longer - len(value))
            into[key] = [a + b for a, b in zip(old, value, strict=True)]
        elif isinstance(value, int | float) and not isinstance(value, bool):
            into[key] = into.get(key, 0) + value


def retire(retired: dict[str, Any], stats: SchedulerStats | None) -> None:
    """Keep the running counts of a replica's incarnation that stopped."""
    if stats is not None:
        _add(retired, msgspec.to_builtins(stats), skip_gauges=True)


def sum_stats(live: list[SchedulerStats], retired: dict[str, Any]) -> SchedulerStats:
    """The replicas' stats as one engine's: counts summed (retired ones included), gauges
    summed over the live replicas, and the KV usage over all their pages."""
    total: dict[str, Any] = {}
    used = 0.0
    for stats in live:
        _add(total, msgspec.to_builtins(stats), skip_gauges=False)
        used += stats.kv_cache_usage * stats.num_blocks
    _add(total, retired, skip_gauges=False)
    num_blocks = total.get("num_blocks", 0)
    total["kv_cache_usage"] = used / num_blocks if num_blocks else 0.0
    return msgspec.convert(total, SchedulerStats)


def hit_rate(stats: SchedulerStats | None) -> float:
    if stats is None or not stats.prefix_cache_queries:
        return 0.0
    return round(stats.prefix_cache_hits / stats.prefix_cache_queries, 6)
