"""The server's resident memory: RSS of the API process and its descendants, sampled while a
server is ready; each server run's warm baseline (taken once every KV page has been written
once), growth from it, and a few samples kept for the results."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import psutil

from .clock import wait_until
from .server_probes import new_kv_tokens, scrape
from .supervisor import Supervisor
from .traffic import Traffic


def tree_rss(pid: int) -> tuple[int, int] | None:
    """(RSS of `pid`, RSS of all its descendants) in bytes, or None if it is gone."""
    try:
        proc = psutil.Process(pid)
        own = proc.memory_info().rss
        kids = 0
        for child in proc.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                kids += child.memory_info().rss
        return own, kids
    except psutil.Error:
        return None


def rss_growth(baseline: float | None, end: float | None) -> float | None:
    """Relative growth of RSS from `baseline` to `end` (0.05 = 5 percent), None if unknown."""
    if not baseline or end is None:
        return None
    return round(end / baseline - 1.0, 4)


def pick_samples(samples: list[dict], k: int = 12) -> list[dict]:
    """At most `k` samples, evenly spaced, first and last included."""
    if len(samples) <= k:
        return samples
    idx = sorted({round(i * (len(samples) - 1) / (k - 1)) for i in range(k)})
    return [samples[i] for i in idx]


class RSSSampler:
    """Samples the server tree's RSS every `interval` s while a server is ready."""

    def __init__(self, sup: Supervisor, interval: float):
        self.sup = sup
        self.interval = interval
        self.samples: list[dict[str, Any]] = []

    def sample(self, label: str = "") -> dict[str, Any] | None:
        """Record one sample of the current server tree (labelled, if `label`); None while no
        server is ready."""
        if not self.sup.ready.is_set() or self.sup.proc is None:
            return None
        self.sup.note_children()
        rss = tree_rss(self.sup.proc.pid)
        if rss is None:
            return None
        s = {
            "t_s": self.sup.now(),
            "run": self.sup.incarnation,
            "api_mib": round(rss[0] / 2**20, 1),
            "children_mib": round(rss[1] / 2**20, 1),
            "total_mib": round(sum(rss) / 2**20, 1),
        }
        if label:
            s["label"] = label
        self.samples.append(s)
        return s

    async def loop(self) -> None:
        """A sample every `interval` s, until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.interval)


async def take_baseline(
    t: Traffic, sampler: RSSSampler, not_before: float, not_after: float, wait_for=()
) -> dict | None:
    """The RSS baseline of the current server: from `not_before` on, once the tasks in
    `wait_for` are done and every KV page has been written once, but by `not_after` at the
    latest. The CPU KV cache is an anonymous map whose pages become resident as they are
    first written, and free pages are handed out oldest first, so the cache has been through
    every page once the tokens written reach its size; before that, RSS grows without a leak."""
    await wait_until(not_before)
    if wait_for:
        await asyncio.wait(wait_for, timeout=max(0.0, not_after - time.monotonic()))
    written = capacity = None
    while True:
        metrics, stats = await scrape(t.base_url)
        if metrics is not None and stats is not None:
            written = max(0.0, new_kv_tokens(metrics))  # hits may be counted before prompts
            capacity = stats.get("kv_pages_total", 0) * t.args.block_size
            if written >= capacity:
                break
        if time.monotonic() >= not_after:
            break
        await asyncio.sleep(2.0)
    sample = sampler.sample("baseline")
    if sample is not None:
        sample["kv_tokens_written"] = written
        sample["kv_tokens_capacity"] = capacity
        sample["kv_written_once"] = written is not None and written >= (capacity or 0)
    return sample
