"""The single-device executor: one `Worker` in this process."""

from __future__ import annotations

from inferengine.config import EngineConfig
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from inferengine.worker.kv_offload import read_pages
from inferengine.worker.pending_step import PendingStep
from inferengine.worker.worker import Worker


class UniprocExecutor:
    def __init__(self, config: EngineConfig):
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def determine_num_host_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_host_blocks()

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.worker.initialize_cache(num_blocks, num_host_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingStep:
        return self.worker.runner.execute_model_async(scheduler_output)

    def read_kv_pages(self, locations: list[tuple[str, int]]) -> list:
        runner = self.worker.runner
        return read_pages(runner.kv_caches, runner.host_tier, locations)

    def write_host_pages(self, slots: list[int], pages: list) -> None:
        assert self.worker.runner.host_tier is not None
        self.worker.runner.host_tier.write(slots, pages)

    def check_health(self) -> None:
        pass

    def expert_token_counts(self) -> dict[int, list[int]]:
        return self.worker.expert_token_counts()

    def propose_drafts(self, wanted: dict[str, tuple[int, list[int]]]) -> dict[str, list[int]]:
        """Draft tokens from the worker's draft model: request -> (k, lookahead page ids)."""
        return self.worker.runner.propose_drafts(wanted)

    @property
    def attention_backend_name(self) -> str:
        return self.worker.attn_backend.name

    @property
    def attention_backend_timings_ms(self) -> dict[str, float]:
        """The start-up benchmark's timings (`--attention-backend-benchmark`), else empty."""
        return self.worker.attn_timings_ms

    def shutdown(self) -> None:
        if self.worker.runner.kv_connector is not None:
            self.worker.runner.kv_connector.close()
