"""Typed engine configuration: one dataclass per concern, held together by `EngineConfig`.

Pure Python (no torch): the scheduler and KV manager read it too. `EngineArgs` in
`engine/arg_utils.py` builds it from CLI flags or `LLM(...)` keyword arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferengine.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flex")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class ModelConfig:
    model: str  # what the user named: an alias, a local path or a hub id
    model_path: str  # local directory holding config.json (and weights unless dummy)
    hf_config: dict[str, Any]
    dtype: str  # resolved: float32, bfloat16 or float16
    max_model_len: int
    tokenizer: str | None = None  # local directory with tokenizer files; None: model_path
    load_format: str = "auto"
    seed: int = 0
    served_model_name: str | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return (self.hf_config.get("architectures") or ["?"])[0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        head_dim = self.hf_config.get("head_dim")
        return int(head_dim or self.hf_config["hidden_size"] // self.num_attention_heads)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes for the KV cache; the CPU budget (default 1 GiB)
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # Set at start-up from the memory measurement.
    num_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(
                f"--block-size must be one of 8, 16, 32, 64, 128; got {self.block_size}."
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may use the whole budget
    policy: str = "fcfs"
    max_waiting_requests: int | None = None  # None: unbounded waiting queue
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy must be one of {SCHEDULING_POLICIES}.")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1.")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        # Until the multi-GPU executor lands, a model runs on one device: refuse, rather than
        # crash at the first step (CPU) or sample from a partial model (GPU).
        for flag, size in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
        ):
            if size < 1:
                raise ConfigError(f"{flag} must be at least 1, got {size}.")
            if size > 1:
                raise ConfigError(
                    f"{flag} {size} is not supported yet: InferEngine runs a model on one GPU. "
                    f"Run with {flag} 1 (the default)."
                )


SPEC_METHODS = ("ngram",)
SPEC_METHODS_PLANNED = ("suffix", "draft_model", "eagle", "eagle3", "mtp")
SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


@dataclass
class SpeculativeConfig:
    """`--speculative-config` / `LLM(speculative_config=...)`, in vLLM's spelling."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if self.method in SPEC_METHODS_PLANNED:
            raise ConfigError(
                f"speculative method {self.method!r} is not supported yet; use "
                '{"method": "ngram", "num_speculative_tokens": 4}.'
            )
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"unknown speculative method {self.method!r}; the supported one is ngram."
            )
        if self.num_speculative_tokens < 1:
            raise ConfigError(
                "num_speculative_tokens must be at least 1, got "
                f"{self.num_speculative_tokens}; leave out --speculative-config to not speculate."
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}."
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(values) - set(SPEC_KEYS))
        if unknown:
            raise ConfigError(
                f"--speculative-config: unknown keys {unknown}; the keys are {', '.join(SPEC_KEYS)}."
            )
        if "num_speculative_tokens" not in values:
            raise ConfigError("--speculative-config needs num_speculative_tokens (e.g. 4).")
        return cls(**values)


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"  # resolved: "cpu" or "cuda"
    attention_backend: str = "auto"
    attention_backend_benchmark: bool = False
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] = field(default_factory=list)
    speculative_config: SpeculativeConfig | None = None
