"""Typed engine configuration: one dataclass per concern, held together by `EngineConfig`.

Pure Python (no torch): the scheduler and KV manager read it too. `EngineArgs` in
`engine/arg_utils.py` builds it from CLI flags or `LLM(...)` keyword arguments.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from typing import Any

from inferengine.errors import ConfigError
from inferengine.pooling_params import PoolerConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton", "flex")
SCHEDULING_POLICIES = ("fcfs", "priority")
MODEL_IMPLS = ("auto", "native", "transformers")
# vLLM's --kv-cache-dtype names: fp8 is fp8_e4m3 (kernels/kv_quant.py maps them to torch dtypes).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = ("none", "fp8")
# How `serve --data-parallel-size N` picks a replica (`dp/router.py`).
ROUTER_POLICIES = ("cache-aware", "round-robin")
# How an engine of several ranks starts them: processes here (mp), or Ray actors on a cluster.
EXECUTOR_BACKENDS = ("mp", "ray")


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
    # auto: native when registered, else Transformers' modeling code; native; transformers
    model_impl: str = "auto"
    # "fp8" (weights FP8 with per-channel scales, activations per token), or None
    quantization: str | None = None
    # A GGUF's Q4_0/Q4_1/Q4_K weights run 4-bit on the CPU unless this is set (then dequantized)
    gguf_dequantize: bool = False
    # A pooling model's pooling (`--runner pooling`, `checkpoint/pooling.py`); None: it generates
    pooler: PoolerConfig | None = None

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
    # Bytes for the KV cache; default on the CPU: a share of the available memory (kv_memory.py).
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_offloading_size: float | None = None  # GiB of host memory for the CPU tier, all ranks
    # auto: the model's dtype; fp8 / fp8_e4m3 / fp8_e5m2: pages of one byte per element.
    cache_dtype: str = "auto"
    # Set at start-up from the memory measurement.
    num_blocks: int = 0
    num_host_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError(
                f"--block-size must be one of 8, 16, 32, 64, 128; got {self.block_size}."
            )
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got "
                f"{self.cache_dtype!r}."
            )
        if self.kv_offloading_size is not None and self.kv_offloading_size < 0:
            raise ConfigError(
                f"--kv-offloading-size is GiB of host memory, 0 or more; got "
                f"{self.kv_offloading_size}."
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
    # The model's context length, not a --max-model-len: lowered to what the KV cache holds.
    max_model_len_auto: bool = False
    long_prefill_token_threshold: int = 0  # 0: a prefill chunk may use the whole budget
    policy: str = "fcfs"
    max_waiting_requests: int | None = None  # None: unbounded waiting queue
    async_scheduling: bool = False
    max_loras: int = 0  # distinct LoRA adapters per step; 0: LoRA is off

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy must be one of {SCHEDULING_POLICIES}.")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("--max-num-batched-tokens must be at least 1.")


@dataclass
class LoRAConfig:
    """Multi-LoRA (`lora/`, `worker/lora_slots.py`): `max_loras` adapters per step in device
    slots of rank `max_lora_rank`, `max_cpu_loras` kept loaded on the host; `runtime_updates`:
    /v1/load_lora_adapter and /v1/unload_lora_adapter are served."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    runtime_updates: bool = False

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be at least 1, got {self.max_loras}.")
        if not 1 <= self.max_lora_rank <= 256:
            raise ConfigError(f"--max-lora-rank must be 1 to 256, got {self.max_lora_rank}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})."
            )


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Engine replicas behind one server, placed by Ray (`inferengine/dp/`); each replica is
    # split tensor_parallel_size x pipeline_parallel_size ways. `world_size` is one replica's.
    data_parallel_size: int = 1
    ray_address: str | None = None  # None: a local Ray started on demand
    # The replicas' router (`--router-*`); None: the router's default. Refused without replicas.
    router_policy: str | None = None
    router_inflight_weight: float | None = None
    router_kv_usage_weight: float | None = None
    router_cpu_hit_weight: float | None = None
    # Where the ranks of one engine run: worker processes on this machine (mp), or Ray actors
    # placed on a cluster's nodes (ray, `executor/ray_executor.py`).
    distributed_executor_backend: str = "mp"

    def __post_init__(self) -> None:
        for flag, size in (
            ("--tensor-parallel-size", self.tensor_parallel_size),
            ("--pipeline-parallel-size", self.pipeline_parallel_size),
            ("--data-parallel-size", self.data_parallel_size),
        ):
            if size < 1:
                raise ConfigError(f"{flag} must be at least 1, got {size}.")
        self._check_executor_backend()
        self._check_router()

    def _check_executor_backend(self) -> None:
        ray_ranks = self.distributed_executor_backend == "ray"
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                f"--distributed-executor-backend must be one of {', '.join(EXECUTOR_BACKENDS)}; "
                f"got {self.distributed_executor_backend!r}."
            )
        if ray_ranks and self.data_parallel_size > 1:
            raise ConfigError(
                "--distributed-executor-backend ray places one engine's ranks; data-parallel "
                "replicas start theirs as processes on their node: drop one of the two flags."
            )
        if self.ray_address and self.data_parallel_size == 1 and not ray_ranks:
            raise ConfigError(
                "--ray-address places data-parallel replicas, or an engine's ranks with "
                "--distributed-executor-backend ray: give one of those, or drop --ray-address."
            )

    def _check_router(self) -> None:
        """The `--router-*` flags: known values, and only where they change something."""
        if self.router_policy is not None and self.router_policy not in ROUTER_POLICIES:
            raise ConfigError(
                f"--router-policy must be one of {', '.join(ROUTER_POLICIES)}; got "
                f"{self.router_policy!r}."
            )
        weights = {
            "--router-inflight-weight": (self.router_inflight_weight, math.inf),
            "--router-kv-usage-weight": (self.router_kv_usage_weight, math.inf),
            "--router-cpu-hit-weight": (self.router_cpu_hit_weight, 1.0),
        }
        for flag, (value, most) in weights.items():
            if value is not None and not (0.0 <= value <= most and math.isfinite(value)):
                accepted = "a number from 0 to 1" if most == 1.0 else "a finite number, 0 or more"
                raise ConfigError(f"{flag} must be {accepted}; got {value}.")
        given = [flag for flag, (value, _) in weights.items() if value is not None]
        if self.data_parallel_size == 1 and (given or self.router_policy is not None):
            flags = ", ".join(["--router-policy"] * (self.router_policy is not None) + given)
            raise ConfigError(
                f"{flags} set how requests are routed between data-parallel replicas, and one "
                "engine has none: give --data-parallel-size 2 or more, or drop them."
            )
        if self.router_policy == "round-robin" and given:
            raise ConfigError(
                f"{', '.join(given)} weigh the cache-aware router's costs; --router-policy "
                "round-robin takes the replicas in turn and reads no weight: drop them, or use "
                "--router-policy cache-aware."
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def check_model(self, m: ModelConfig, what: str = "the model") -> None:
        """Refuse a split the model's shape does not allow, saying which sizes would work."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        heads, kv = m.num_attention_heads, m.num_kv_heads
        mlp = int(m.hf_config["intermediate_size"])
        moe = int(m.hf_config.get("moe_intermediate_size") or mlp)  # Qwen3-MoE's experts
        ok = [
            n
            for n in range(1, heads + 1)
            if heads % n == 0 and (kv % n == 0 or n % kv == 0) and mlp % n == 0 and moe % n == 0
        ]
        if tp not in ok:
            raise ConfigError(
                f"--tensor-parallel-size {tp} does not divide {what}'s {heads} attention heads, "
                f"{kv} KV heads and MLP size {mlp}"
                + (f" (experts {moe})" if moe != mlp else "")
                + f"; use one of {ok}."
            )
        if pp > m.num_layers:
            raise ConfigError(
                f"--pipeline-parallel-size {pp} is more than {what}'s {m.num_layers} layers."
            )


SPEC_METHODS = ("ngram", "suffix", "draft_model")
SPEC_METHODS_PLANNED = ("eagle", "eagle3", "mtp")
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_SUFFIX_KEYS = (
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)
_DRAFT_KEYS = ("model",)
SPEC_KEYS = ("method", "num_speculative_tokens", *_NGRAM_KEYS, *_SUFFIX_KEYS, *_DRAFT_KEYS)
_METHOD_KEYS = {"ngram": _NGRAM_KEYS, "suffix": _SUFFIX_KEYS, "draft_model": _DRAFT_KEYS}
# Drafts one step may verify, over all its requests: start-up reserves memory for a logits row
# (full vocabulary) per request and per draft.
MAX_DRAFTS_PER_STEP = 768


@dataclass
class SpeculativeConfig:
    """`--speculative-config` / `LLM(speculative_config=...)`, in vLLM's spelling.

    ngram: prompt lookup over the request's own tokens. suffix: a suffix tree over the
    request's tokens and recent requests' outputs. draft_model: a smaller model (`model`, a
    local path) with the target's vocabulary, its KV pages in the same pool as the target's.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None
    # Set at start-up for draft_model: the draft's resolved config.
    draft_model_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.method in SPEC_METHODS_PLANNED:
            raise ConfigError(
                f"speculative method {self.method!r} is not supported yet; the supported "
                f"methods are {', '.join(SPEC_METHODS)}, e.g. "
                '{"method": "ngram", "num_speculative_tokens": 4}.'
            )
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"unknown speculative method {self.method!r}; the supported methods are "
                f"{', '.join(SPEC_METHODS)}."
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
        if self.suffix_decoding_max_tree_depth < 1:
            raise ConfigError("suffix_decoding_max_tree_depth must be at least 1.")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError(
                "suffix_decoding_max_cached_requests must be 0 or more (0: no cross-request cache)."
            )
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ConfigError("suffix_decoding_max_spec_factor must be positive.")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ConfigError("suffix_decoding_min_token_prob must be in [0, 1].")
        if self.method == "draft_model" and not self.model:
            raise ConfigError(
                'method "draft_model" needs "model": the path of a smaller model with the '
                'target\'s tokenizer, e.g. {"method": "draft_model", "model": "/models/small", '
                '"num_speculative_tokens": 4}.'
            )

    def max_logits_rows(self, max_num_seqs: int) -> int:
        """The most logits rows a step samples: one per request and one per draft, of which
        the engine core gives at most `MAX_DRAFTS_PER_STEP` a step."""
        return max_num_seqs + min(max_num_seqs * self.num_speculative_tokens, MAX_DRAFTS_PER_STEP)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        unknown = sorted(set(values) - set(SPEC_KEYS))
        if unknown:
            raise ConfigError(
                f"--speculative-config: unknown keys {unknown}; the keys are {', '.join(SPEC_KEYS)}."
            )
        method = values.get("method", "ngram")
        others = sorted(
            k for m, keys in _METHOD_KEYS.items() if m != method for k in keys if k in values
        )
        if method in _METHOD_KEYS and others:
            raise ConfigError(
                f"--speculative-config: {others} do not apply to method {method!r}; its own "
                f"keys are {', '.join(_METHOD_KEYS[method]) or 'none'}."
            )
        values = dict(values)
        if method == "suffix":
            values.setdefault(
                "num_speculative_tokens",
                values.get("suffix_decoding_max_tree_depth", cls.suffix_decoding_max_tree_depth),
            )
        if "num_speculative_tokens" not in values:
            raise ConfigError("--speculative-config needs num_speculative_tokens (e.g. 4).")
        return cls(**values)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_CONNECTORS = ("NixlConnector", "SharedMemoryConnector")


@dataclass
class KVTransferConfig:
    """`--kv-transfer-config` / `LLM(kv_transfer_config=...)` in vLLM's spelling: this engine's
    side of disaggregated prefill and decode (`kv_transfer/`). `kv_connector` None: the best
    transport that loads (NIXL, else shared memory)."""

    kv_role: str = "kv_both"
    kv_connector: str | None = None
    engine_id: str | None = None  # default: a fresh id per start
    kv_ip: str = "127.0.0.1"  # the address consumers are told to reach this engine at
    kv_port: int | None = None
    kv_hold_timeout_s: float = 60.0  # a producer frees pages no consumer took by then
    kv_load_timeout_s: float = 30.0  # a consumer recomputes a prompt whose pages took longer
    kv_buffer_dir: str = "/dev/shm"  # SharedMemoryConnector: where the page files live

    def __post_init__(self) -> None:
        if self.engine_id is None:
            self.engine_id = uuid.uuid4().hex[:16]
        if self.kv_role not in KV_ROLES:
            raise ConfigError(
                f"kv_transfer_config: kv_role must be one of {', '.join(KV_ROLES)}; "
                f"got {self.kv_role!r}."
            )
        if self.kv_connector is not None and self.kv_connector not in KV_CONNECTORS:
            raise ConfigError(
                f"kv_transfer_config: kv_connector must be one of {', '.join(KV_CONNECTORS)} "
                f"(or left out for the best one that loads); got {self.kv_connector!r}."
            )
        for name in ("kv_hold_timeout_s", "kv_load_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"kv_transfer_config: {name} must be a positive number.")
        if self.kv_port is not None and (
            isinstance(self.kv_port, bool)
            or not isinstance(self.kv_port, int)
            or not 0 < self.kv_port < 65536
        ):
            raise ConfigError(
                f"kv_transfer_config: kv_port must be a port number, not {self.kv_port!r}."
            )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"kv_transfer_config: unknown key(s) {', '.join(unknown)}; the keys are "
                f"{', '.join(sorted(known))}."
            )
        for name in ("kv_role", "kv_connector", "engine_id", "kv_ip", "kv_buffer_dir"):
            value = values.get(name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"kv_transfer_config: {name} must be a string, not {value!r}.")
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
    warmup: bool = False  # run the cold kernel variants once before reporting ready
    kv_transfer_config: KVTransferConfig | None = None  # disaggregated prefill/decode
    lora_config: LoRAConfig | None = None  # Multi-LoRA; None: off

    def __post_init__(self) -> None:
        if self.parallel_config.router_cpu_hit_weight is not None and not (
            self.cache_config.kv_offloading_size
        ):
            raise ConfigError(
                "--router-cpu-hit-weight prices prompt tokens found in a replica's CPU tier, and "
                "there is none: add --kv-offloading-size, or drop the weight."
            )
