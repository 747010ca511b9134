"""`inferengine:lora_requests_info` (vLLM's gauge): one series labelled with the adapters running
and waiting and --max-loras, replaced when they change."""

from __future__ import annotations

from prometheus_client import generate_latest

from inferengine.core.engine_io import SchedulerStats
from inferengine.lora.request import LoRARequest, LoRAStats, lora_stats
from inferengine.metrics.prometheus import PrometheusStatLogger


class _Req:
    def __init__(self, lora: LoRARequest | None):
        self.lora_request = lora


def test_the_scheduler_stats_name_running_and_waiting_adapters():
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    stats = lora_stats([_Req(b), _Req(None), _Req(a), _Req(b)], [_Req(a)], 2)
    assert stats == LoRAStats(2, ["a", "b"], ["a"])
    assert lora_stats([_Req(a)], [], 0) is None  # LoRA off: no gauge


def test_the_gauge_keeps_one_series_of_the_latest_adapters():
    logger = PrometheusStatLogger("m", 128, 64)
    logger.update_scheduler_stats(SchedulerStats(lora=LoRAStats(2, ["a", "b"], ["c"])))
    text = generate_latest(logger.registry).decode()
    assert (
        'inferengine:lora_requests_info{max_lora="2",running_lora_adapters="a,b",'
        'waiting_lora_adapters="c"}' in text
    )
    logger.update_scheduler_stats(SchedulerStats(lora=LoRAStats(2, ["c"], [])))
    text = generate_latest(logger.registry).decode()
    series = [line for line in text.splitlines() if line.startswith("inferengine:lora_requests")]
    assert len(series) == 1 and 'running_lora_adapters="c"' in series[0]
