"""The executor protocol the engine core talks to, and the choice of executor.

The engine core holds an `Executor`, never a concrete class: `UniprocExecutor` runs one worker in
this process, `MultiprocExecutor` one worker process per rank (tensor × pipeline parallel),
`RayExecutor` one Ray actor per rank, on a cluster's nodes (`--distributed-executor-backend ray`).
"""

from __future__ import annotations

from typing import Protocol

from inferengine.config import EngineConfig
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput


class StepHandle(Protocol):
    """A launched step; `resolve()` waits for it and returns its output (once computed, the
    same object on every call)."""

    graph_size: int | None  # the CUDA graph the step replayed, if the executor knows it

    def resolve(self) -> ModelRunnerOutput: ...

    def provide_grammar(self, req_ids: list[str], bitmask: bytes) -> None:
        """A step launched with `grammar_deferred`: its grammar masks, so it can sample."""
        ...


class Executor(Protocol):
    def determine_num_blocks(self) -> int: ...

    def determine_num_host_blocks(self) -> tuple[int, int]:
        """CPU tier pages every rank can hold (the fewest), and the bytes of one page summed
        over the ranks."""
        ...

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None: ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle: ...

    def propose_drafts(self, wanted: dict[str, tuple[int, list[int]]]) -> dict[str, list[int]]: ...

    def read_kv_pages(self, locations: list[tuple[str, int]]) -> list:
        """Host copies of KV pages, ("gpu", page) or ("host", slot) each (KV transfer)."""
        ...

    def write_host_pages(self, slots: list[int], pages: list) -> None:
        """Fill CPU tier slots with imported pages (KV transfer)."""
        ...

    def check_health(self) -> None:
        """Raise `EngineDeadError` if a worker is gone."""
        ...

    def expert_token_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since start-up, by layer index (mixture-of-experts
        models; empty otherwise). Reads device counters: for metrics, not the step loop."""
        ...

    @property
    def attention_backend_name(self) -> str: ...

    @property
    def attention_backend_timings_ms(self) -> dict[str, float]: ...

    def shutdown(self) -> None: ...


def make_executor(config: EngineConfig) -> Executor:
    if config.parallel_config.distributed_executor_backend == "ray":
        from inferengine.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    if config.parallel_config.world_size > 1:
        from inferengine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    from inferengine.executor.uniproc import UniprocExecutor

    return UniprocExecutor(config)
