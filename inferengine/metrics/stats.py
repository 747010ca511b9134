"""Per-iteration and per-request statistics gathered in the API process, for metrics and /stats."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from inferengine.core.engine_io import SchedulerStats


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    queue_time: float
    prefill_time: float
    decode_time: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one batch of engine-core outputs added."""

    timestamp: float = field(default_factory=time.time)
    num_prompt_tokens: int = 0  # prompts whose first token arrived in this batch
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(ABC):
    """Receives every batch's stats; subclasses export them (Prometheus, logs)."""

    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        """Called once per batch of engine-core outputs."""


class ThroughputWindow:
    """Prompt and generation tokens per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: deque[tuple[float, int, int]] = deque()

    def add(self, iteration: IterationStats) -> None:
        if iteration.num_prompt_tokens or iteration.num_generation_tokens:
            self._events.append(
                (iteration.timestamp, iteration.num_prompt_tokens, iteration.num_generation_tokens)
            )

    def rates(self, now: float | None = None) -> tuple[float, float]:
        now = time.time() if now is None else now
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        prompt = sum(e[1] for e in self._events)
        generation = sum(e[2] for e in self._events)
        return prompt / self.window_s, generation / self.window_s
