"""The stats the API process gathers: an iteration's defaults, the stat-logger interface, and the
throughput window (tokens per second over the last seconds, old batches dropped)."""

from __future__ import annotations

import time

import pytest

from inferengine.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    StatLogger,
    ThroughputWindow,
)


def at(t: float, prompt: int = 0, generation: int = 0) -> IterationStats:
    return IterationStats(timestamp=t, num_prompt_tokens=prompt, num_generation_tokens=generation)


def test_an_iteration_starts_empty_with_its_own_lists():
    before = time.time()
    a, b = IterationStats(), IterationStats()
    assert before <= a.timestamp <= b.timestamp <= time.time()
    assert (a.num_prompt_tokens, a.num_generation_tokens) == (0, 0)
    a.time_to_first_tokens.append(0.1)
    a.finished.append(FinishedRequestStats("stop", 1.0, 0.0, 0.5, 0.5, 3, 4))
    assert b.time_to_first_tokens == [] and b.finished == [] and b.inter_token_latencies == []


def test_a_stat_logger_must_record():
    with pytest.raises(TypeError):
        StatLogger()  # type: ignore[abstract]

    class Keeping(StatLogger):
        def __init__(self):
            self.seen = []

        def record(self, scheduler_stats, iteration):
            self.seen.append((scheduler_stats, iteration))

    keeping, it = Keeping(), IterationStats()
    keeping.record(None, it)
    assert keeping.seen == [(None, it)]


def test_rates_over_the_window():
    w = ThroughputWindow(window_s=10.0)
    w.add(at(100.0, prompt=50, generation=5))
    w.add(at(104.0, generation=20))
    w.add(at(108.0, prompt=30, generation=15))
    assert w.rates(now=109.0) == (8.0, 4.0)  # 80 and 40 tokens over 10 s
    # At 112 the batch of 100 s is 12 s old: gone.
    assert w.rates(now=112.0) == (3.0, 3.5)
    assert w.rates(now=114.0) == (3.0, 3.5)  # 104 is exactly 10 s old: still in
    assert w.rates(now=118.5) == (0.0, 0.0)
    # Dropped batches stay dropped even for an earlier `now`.
    assert w.rates(now=109.0) == (0.0, 0.0)


def test_prompt_and_generation_tokens_are_counted_apart():
    w = ThroughputWindow(window_s=2.0)
    w.add(at(10.0))  # nothing: not kept
    w.add(at(10.5, generation=4))
    w.add(at(10.8, prompt=7))
    assert w.rates(now=11.0) == (3.5, 2.0)


def test_rates_default_to_now(monkeypatch):
    w = ThroughputWindow(window_s=5.0)
    w.add(at(1000.0, prompt=10, generation=10))
    monkeypatch.setattr("time.time", lambda: 1003.0)
    assert w.rates() == (2.0, 2.0)
    monkeypatch.setattr("time.time", lambda: 1006.0)
    assert w.rates() == (0.0, 0.0)
