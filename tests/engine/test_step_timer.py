"""`StepTimer` (INFERENGINE_STEP_STATS_INTERVAL): steps counted by kind, host time per phase
averaged per step, logged once per interval and then started afresh."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inferengine.core.sched_output import SchedulerOutput
from inferengine.engine import step_timer
from inferengine.engine.step_timer import StepTimer


def step(num_tokens: int) -> SchedulerOutput:
    return SchedulerOutput([], [], {"r": num_tokens} if num_tokens else {}, num_tokens)


@pytest.fixture
def clock(monkeypatch):
    now = SimpleNamespace(t=100.0)
    monkeypatch.setattr(step_timer, "time", SimpleNamespace(perf_counter=lambda: now.t))
    return now


@pytest.fixture
def logged(monkeypatch) -> list[str]:
    lines: list[str] = []
    monkeypatch.setattr(step_timer.logger, "info", lambda m, *a: lines.append(m % a))
    return lines


def test_steps_by_kind_and_host_time_per_phase(clock, logged):
    timer = StepTimer(interval_s=10.0)
    timer.launched(step(5), SimpleNamespace(graph_size=8), schedule_s=0.001, launch_s=0.002)
    timer.launched(step(3), SimpleNamespace(graph_size=None), schedule_s=0.001, launch_s=0.004)
    timer.launched(step(0), None, schedule_s=0.001, launch_s=0.0)
    assert dict(timer.steps) == {"graph": 1, "eager": 1, "empty": 1}
    assert timer.tokens == 8
    for _ in range(3):
        timer.resolved(wait_s=0.004, update_s=0.001)
    assert logged == []  # the interval has not passed
    assert timer.seconds["wait"] == pytest.approx(0.012)
    assert timer.seconds["launch_eager"] == pytest.approx(0.004)


def test_one_line_per_interval_then_a_fresh_count(clock, logged):
    timer = StepTimer(interval_s=10.0)
    timer.launched(step(5), SimpleNamespace(graph_size=8), schedule_s=0.003, launch_s=0.002)
    timer.launched(step(4), object(), schedule_s=0.001, launch_s=0.004)  # no graph_size: eager
    timer.resolved(wait_s=0.006, update_s=0.001)
    clock.t = 112.0
    timer.resolved(wait_s=0.002, update_s=0.003)
    (line,) = logged
    assert line == (
        "steps {'graph': 1, 'eager': 1} in 12.0 s (6000.00 ms/step, 4 tokens/step); host ms/step "
        "{'schedule': '2.00', 'launch_graph': '1.00', 'launch_eager': '2.00', 'wait': '4.00', "
        "'update': '2.00'}"
    )
    assert (timer.start, dict(timer.steps), dict(timer.seconds), timer.tokens) == (112.0, {}, {}, 0)
    clock.t = 121.0
    timer.resolved(wait_s=0.0, update_s=0.0)
    assert len(logged) == 1  # 9 s into the new interval
    clock.t = 122.0
    timer.resolved(wait_s=0.0, update_s=0.0)
    assert logged[1].startswith("steps {} in 10.0 s (10000.00 ms/step, 0 tokens/step)")
