"""Typed settings of a serving benchmark: the workload (same for every system) and the client run."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
DATASET_NAMES = ("random", "sharegpt", "prefix-repetition", "custom")
ENDPOINT_BACKENDS = {"/v1/completions": "openai", "/v1/chat/completions": "openai-chat"}


def percentile_label(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9" (the `pX` in `p99_ttft_ms`)."""
    return str(int(p)) if int(p) == p else str(p)


@dataclass
class DatasetConfig:
    """Which prompts to send and how many tokens to ask for (defaults are vLLM's)."""

    name: str = "random"
    path: str | None = None
    num_prompts: int = 1000
    seed: int = 0
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    sharegpt_output_len: int | None = None
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_output_len: int = 128
    # custom: a JSONL file of {"prompt": text} sent as they are (already chat-formatted), in
    # file order, each asking for custom_output_len tokens
    custom_output_len: int = 256


@dataclass
class WorkloadConfig:
    """Everything that must be identical when two systems are compared."""

    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    endpoint: str = "/v1/completions"
    max_concurrency: int | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    ignore_eos: bool = False
    temperature: float | None = 0.0
    num_warmups: int = 0
    request_timeout_s: float | None = 1800.0
    extra_body: dict = field(default_factory=dict)
    goodput: dict[str, float] = field(default_factory=dict)
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS
    metric_percentiles: tuple[float, ...] = (99.0,)

    @property
    def backend(self) -> str:
        """vLLM's name for the request format (`openai` or `openai-chat`)."""
        return ENDPOINT_BACKENDS.get(self.endpoint, "openai")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


@dataclass
class ServeConfig:
    """One `bench serve` run: a workload against one server, and where its result goes."""

    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    base_url: str = "http://127.0.0.1:8000"
    model: str | None = None
    tokenizer: str | None = None
    label: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    disable_tqdm: bool = False
    save_result: bool = False
    result_dir: str | None = None
    result_filename: str | None = None
