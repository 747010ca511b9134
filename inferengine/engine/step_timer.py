"""Where the engine core's time goes, step by step (`INFERENGINE_STEP_STATS_INTERVAL`)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from inferengine.core.sched_output import SchedulerOutput
from inferengine.logger import init_logger

logger = init_logger(__name__)


class StepTimer:
    """Sums host time per phase and counts steps by kind; logs the averages now and then."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self.start = now
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self.tokens = 0

    def launched(
        self, so: SchedulerOutput, pending: Any, schedule_s: float, launch_s: float
    ) -> None:
        kind = "graph" if getattr(pending, "graph_size", None) else "eager"
        if so.is_empty:
            kind = "empty"
        self.steps[kind] += 1
        self.seconds["schedule"] += schedule_s
        self.seconds[f"launch_{kind}"] += launch_s
        self.tokens += so.total_num_scheduled_tokens

    def resolved(self, wait_s: float, update_s: float) -> None:
        self.seconds["wait"] += wait_s
        self.seconds["update"] += update_s
        now = time.perf_counter()
        if now - self.start >= self.interval_s:
            total = sum(self.steps.values()) or 1
            wall = now - self.start
            per_step = {k: f"{v / total * 1e3:.2f}" for k, v in self.seconds.items()}
            logger.info(
                "steps %s in %.1f s (%.2f ms/step, %d tokens/step); host ms/step %s",
                dict(self.steps),
                wall,
                wall / total * 1e3,
                self.tokens // total,
                per_step,
            )
            self._reset(now)
