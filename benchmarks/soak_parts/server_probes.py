"""What the soak reads from the server over HTTP: /metrics (parsed by the agent benchmark's
Prometheus reader, namespace dropped) and /stats, whether nothing is running, waiting or holding
a KV page, the tokens written into KV pages so far, and the state recorded at the end."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from inferengine.bench.agent import parse_prometheus

# The /metrics samples the soak reads (`inferengine:<name>`, summed over their label sets).
METRICS = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "kv_leased_blocks",
    "kv_sessions",
    "num_preemptions_total",
    "prefix_cache_hits_total",
    "prefix_cache_queries_total",
    "prompt_tokens_total",
    "generation_tokens_total",
)
# The /stats fields recorded in the end state.
END_STATS = (
    "kv_pages_total",
    "kv_pages_used",
    "kv_pages_free",
    "kv_pages_cached",
    "num_requests_in_flight",
    "prefix_cache_hit_rate",
)


async def scrape(base_url: str) -> tuple[dict[str, float] | None, dict | None]:
    """(/metrics samples of METRICS, /stats body), either None where unavailable."""
    metrics = stats = None
    async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as c:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await c.get("/metrics")
            if r.status_code == 200:
                metrics = parse_prometheus(r.text, METRICS)
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await c.get("/stats")
            if r.status_code == 200:
                stats = r.json()
    return metrics, stats


def is_idle(metrics: dict[str, float] | None, stats: dict | None) -> bool:
    """No request running or waiting and no KV page held by a request (prefix-cached and leased
    free pages are free); False when either scrape failed."""
    if metrics is None or stats is None:
        return False
    return (
        metrics.get("num_requests_running") == 0
        and metrics.get("num_requests_waiting") == 0
        and metrics.get("kv_cache_usage_perc") == 0
        and stats.get("kv_pages_used") == 0
        and stats.get("num_requests_in_flight") == 0
    )


async def wait_for_idle(base_url: str, settle_s: float) -> tuple[dict | None, dict | None]:
    """Scrape every second until the server is idle or `settle_s` has passed; the last scrape."""
    settle = time.monotonic() + settle_s
    while True:
        metrics, stats = await scrape(base_url)
        if is_idle(metrics, stats) or time.monotonic() > settle:
            return metrics, stats
        await asyncio.sleep(1.0)


def end_state(metrics: dict[str, float] | None, stats: dict | None) -> dict[str, float | None]:
    """The gauges and counters recorded at the end; None where not scraped."""
    m = metrics or {}
    out = {
        "num_requests_running": m.get("num_requests_running"),
        "num_requests_waiting": m.get("num_requests_waiting"),
        "kv_cache_usage_perc": m.get("kv_cache_usage_perc"),
        "kv_leased_blocks": m.get("kv_leased_blocks"),
        "kv_sessions": m.get("kv_sessions"),
        "num_preemptions": m.get("num_preemptions_total"),
        "prefix_cache_hits": m.get("prefix_cache_hits_total"),
        "prefix_cache_queries": m.get("prefix_cache_queries_total"),
    }
    for key in END_STATS:
        out[f"stats.{key}"] = (stats or {}).get(key)
    return out


def new_kv_tokens(metrics: dict[str, float]) -> float:
    """Tokens written into KV pages so far: prompt tokens not found in the prefix cache, plus
    generated ones."""
    prompt = metrics.get("prompt_tokens_total", 0.0)
    hits = metrics.get("prefix_cache_hits_total", 0.0)
    return prompt - hits + metrics.get("generation_tokens_total", 0.0)
