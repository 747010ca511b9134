"""`EngineArgs`: the engine's user-facing settings, shared by `LLM(...)` and the CLI flags.

`create_engine_config()` resolves the model to a local folder, picks the device and dtype and
fills defaults, giving the typed `EngineConfig` the engine runs on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from inferengine import envs
from inferengine.checkpoint.aliases import ALIASES, DEFAULT_MODEL
from inferengine.checkpoint.architecture import choose_implementation, fallback_hf_config
from inferengine.checkpoint.pooling import encoder_limits, resolve_pooler
from inferengine.checkpoint.quantization import resolve_quantization
from inferengine.checkpoint.resolve import resolve_model
from inferengine.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MODEL_IMPLS,
    ROUTER_POLICIES,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from inferengine.engine.arg_checks import check_fallback, check_offloading, check_parallel
from inferengine.engine.arg_help import ENGINE_HELP
from inferengine.errors import ConfigError, InvalidRequestError
from inferengine.logger import init_logger
from inferengine.lora.config import lora_config_from_args

logger = init_logger(__name__)

_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32"}


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    revision: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    seed: int = 0
    generation_config: str = "auto"
    load_format: str = "auto"
    model_impl: str = "auto"
    quantization: str | None = None
    gguf_dequantize: bool = False
    device: str = "auto"
    attention_backend: str = "auto"
    attention_backend_benchmark: bool = False
    enforce_eager: bool = False
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    ray_address: str | None = None
    router_policy: str | None = None
    router_inflight_weight: float | None = None
    router_kv_usage_weight: float | None = None
    router_cpu_hit_weight: float | None = None
    num_gpu_blocks_override: int | None = None
    kv_offloading_size: float | None = None
    max_waiting_requests: int | None = None
    async_scheduling: bool = True
    served_model_name: str | None = None
    speculative_config: dict | str | None = None
    kv_transfer_config: dict | str | None = None
    warmup: bool | None = None  # None: on for CUDA, off on the CPU
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    enable_runtime_lora: bool = False
    runner: str = "auto"
    convert: str = "auto"

    def create_engine_config(self) -> EngineConfig:
        # Checked before the model is resolved (which may download it).
        parallel_config = ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.data_parallel_size,
            self.ray_address,
            self.router_policy,
            self.router_inflight_weight,
            self.router_kv_usage_weight,
            self.router_cpu_hit_weight,
            distributed_executor_backend=self.distributed_executor_backend,
        )
        _check_revision(self.model, self.revision)
        dtype_name = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        if dtype_name not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}.")
        device = _resolve_device(self.device)
        if self.model_impl not in MODEL_IMPLS:
            raise ConfigError(
                f"--model-impl must be one of {', '.join(MODEL_IMPLS)}; got {self.model_impl!r}."
            )
        resolved = resolve_model(self.model, self.load_format, self.revision)
        pooler = resolve_pooler(resolved.path, resolved.hf_config, self.runner, self.convert)
        if dtype_name == "auto":
            dtype_name = _auto_dtype(device)
        hf, native = _model_implementation(resolved.hf_config, self.model_impl)
        quantization = resolve_quantization(self.quantization, hf, native)
        max_model_len = self.max_model_len  # 0 is refused below, not taken for unset
        if max_model_len is None:
            max_model_len = _context_len(hf)
        if max_model_len < 1:
            raise ConfigError(f"--max-model-len must be at least 1, got {max_model_len}.")
        if max_model_len > _context_len(hf):
            raise ConfigError(
                f"--max-model-len {max_model_len} is longer than the model's context "
                f"({_context_len(hf)} positions, max_position_embeddings in its config.json): "
                "its position table ends there; lower --max-model-len or leave it out."
            )
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if device == "cuda" else 2048
        if pooler is not None and pooler.bidirectional:
            max_model_len, budget = encoder_limits(pooler, max_model_len, budget, self)
        speculative = _speculative_config(self.speculative_config)
        model_config = ModelConfig(
            model=self.model,
            model_path=str(resolved.path),
            hf_config=hf,
            dtype=dtype_name,
            max_model_len=max_model_len,
            tokenizer=self.tokenizer or str(resolved.path),
            load_format=resolved.load_format,
            seed=self.seed,
            served_model_name=self.served_model_name,
            generation_config=_generation_config(
                resolved.generation_config, self.generation_config, resolved.path
            ),
            model_impl=self.model_impl,
            quantization=quantization,
            gguf_dequantize=self.gguf_dequantize,
            pooler=pooler,
        )
        if not native:
            check_fallback(parallel_config, device, self.enforce_eager)
        if speculative is not None and speculative.method == "draft_model":
            speculative.draft_model_config = _draft_model_config(
                speculative, model_config, self.load_format
            )
        check_parallel(parallel_config, model_config, speculative, device, native)
        check_offloading(self.kv_offloading_size, self.enable_prefix_caching, speculative)
        kv_transfer = _kv_transfer_config(self.kv_transfer_config, parallel_config)
        lora = lora_config_from_args(
            self.enable_lora,
            self.max_loras,
            self.max_lora_rank,
            self.max_cpu_loras,
            self.enable_runtime_lora,
            speculative=speculative,
            parallel=parallel_config,
            device=device,
            enforce_eager=self.enforce_eager,
            native=native,
            pooling=getattr(model_config, "pooler", None) is not None,
            kv_transfer=kv_transfer is not None,
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory=self.kv_cache_memory,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                kv_offloading_size=self.kv_offloading_size,
                cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                max_model_len=max_model_len,
                max_model_len_auto=self.max_model_len is None,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                max_waiting_requests=self.max_waiting_requests,
                async_scheduling=self.async_scheduling,
                max_loras=lora.max_loras if lora else 0,
            ),
            parallel_config=parallel_config,
            device=device,
            attention_backend=self.attention_backend,
            attention_backend_benchmark=self.attention_backend_benchmark,
            enforce_eager=self.enforce_eager or device != "cuda" or not native,
            speculative_config=speculative,
            warmup=self.warmup if self.warmup is not None else device == "cuda",
            kv_transfer_config=kv_transfer,
            lora_config=lora,
        )

    # ---- CLI ---------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_positional: bool = True) -> None:
        """Flags in vLLM's spelling; each default can also come from `INFERENGINE_<FLAG>`."""
        choices = {
            "dtype": [*DTYPES, *_DTYPE_ALIASES],
            "load_format": LOAD_FORMATS,
            "model_impl": MODEL_IMPLS,
            "attention_backend": ATTENTION_BACKENDS,
            "scheduling_policy": SCHEDULING_POLICIES,
            "device": ("auto", "cuda", "cpu"),
            "kv_cache_dtype": KV_CACHE_DTYPES,
            "router_policy": ROUTER_POLICIES,
            "distributed_executor_backend": EXECUTOR_BACKENDS,
        }
        for f in fields(cls):
            default = _env_default(f) if envs.cli_default(f.name) is not None else f.default
            flag = "--" + f.name.replace("_", "-")
            help_text = ENGINE_HELP.get(f.name, "")
            if f.name == "model" and model_positional:
                parser.add_argument("model", nargs="?", default=default, help=help_text)
                continue
            if f.type in ("bool", "bool | None"):
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
                )
                continue
            kind = _PARSERS.get(f.name) or _arg_type(f.type)
            parser.add_argument(
                flag, type=kind, default=default, choices=choices.get(f.name), help=help_text
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)


def _generation_config(model_file: dict[str, Any], choice: str, model_path: Path) -> dict:
    """The model's generation config with `--generation-config` applied to its sampling keys:
    kept (auto), dropped (vllm) or taken from FOLDER/generation_config.json. Logs the request
    defaults once; a value `SamplingParams` refuses fails here, not in every request."""
    from inferengine.sampling_params import (
        GENERATION_CONFIG_SAMPLING_KEYS,
        SamplingParams,
        sampling_defaults,
    )

    config = {k: v for k, v in model_file.items() if k not in GENERATION_CONFIG_SAMPLING_KEYS}
    source = None
    if choice == "auto":
        source = model_path / "generation_config.json"
        config |= {k: v for k, v in model_file.items() if k in GENERATION_CONFIG_SAMPLING_KEYS}
    elif choice != "vllm":
        source = Path(choice).expanduser() / "generation_config.json"
        if not source.is_file():
            raise ConfigError(
                f"--generation-config {choice}: no {source}. Give auto (the model's file), vllm "
                "(built-in defaults) or a folder holding a generation_config.json."
            )
        try:
            folder_file = json.loads(source.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{source} is not valid JSON ({e}).") from e
        config |= {k: v for k, v in folder_file.items() if k in GENERATION_CONFIG_SAMPLING_KEYS}
    defaults = sampling_defaults(config)
    try:
        SamplingParams(**defaults)
    except (InvalidRequestError, TypeError) as e:
        raise ConfigError(
            f"the sampling defaults from {source} are invalid ({e}); fix the file or pass "
            "--generation-config vllm."
        ) from e
    if defaults:
        listed = " ".join(f"{k}={v}" for k, v in defaults.items())
        logger.info(
            "default sampling from %s: %s (requests that set a field keep theirs; "
            "--generation-config vllm ignores the file)",
            source,
            listed,
        )
    else:
        logger.info(
            "default sampling: built-in (temperature=1.0 top_p=1.0 top_k=0 min_p=0.0 "
            "repetition_penalty=1.0)"
        )
    return config


def _speculative_config(value: dict | str | None) -> SpeculativeConfig | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = _json_object(value)
    if not isinstance(value, dict):
        raise ConfigError("--speculative-config must be a JSON object, e.g. '{\"method\": ...}'.")
    return SpeculativeConfig.from_dict(value)


def _kv_transfer_config(
    value: dict | str | None, parallel: ParallelConfig
) -> KVTransferConfig | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"--kv-transfer-config is not valid JSON ({e}); write e.g. "
                '\'{"kv_role": "kv_producer", "kv_connector": "NixlConnector"}\'.'
            ) from e
    if not isinstance(value, dict):
        raise ConfigError(
            '--kv-transfer-config must be a JSON object, e.g. \'{"kv_role": "kv_consumer"}\'.'
        )
    if parallel.world_size > 1 or parallel.data_parallel_size > 1:
        raise ConfigError(
            "--kv-transfer-config works on one-rank engines only so far: drop "
            "--tensor-parallel-size, --pipeline-parallel-size and --data-parallel-size."
        )
    return KVTransferConfig.from_dict(value)


def _model_implementation(hf_config: dict, model_impl: str) -> tuple[dict, bool]:
    """Pick native or Transformers code (logged once, with the reason); the Transformers
    fallback's config gains the standard keys it spells otherwise (GPT-2's n_layer, ...)."""
    impl = choose_implementation(hf_config, model_impl)
    logger.info("%s", impl.describe())
    if impl.native:
        return hf_config, True
    return fallback_hf_config(hf_config), False


def _context_len(hf_config: dict) -> int:
    """The positions a checkpoint reaches (2048 when its config does not say)."""
    return int(hf_config.get("max_position_embeddings") or 2048)


def _draft_model_config(
    spec: SpeculativeConfig, target: ModelConfig, load_format: str
) -> ModelConfig:
    """The draft model of `draft_model` speculation: it must share the target's vocabulary
    and reach --max-model-len."""
    assert spec.model is not None
    resolved = resolve_model(spec.model, load_format)
    draft = ModelConfig(
        model=spec.model,
        model_path=str(resolved.path),
        hf_config=resolved.hf_config,
        dtype=target.dtype,
        max_model_len=target.max_model_len,
        load_format=resolved.load_format,
        seed=target.seed,
        generation_config=resolved.generation_config,
    )
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(
            f"the draft model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, the "
            f"target {target.vocab_size}: drafts must be the target's token ids. Pick a draft "
            "model with the target's tokenizer (e.g. a smaller model of the same family)."
        )
    context = _context_len(resolved.hf_config)
    if context < target.max_model_len:
        raise ConfigError(
            f"the draft model {spec.model!r} reaches {context} positions, fewer than "
            f"--max-model-len {target.max_model_len}; lower --max-model-len to {context} or pick "
            "a draft with a longer context."
        )
    return draft


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--speculative-config is not valid JSON ({e}); write e.g. "
            '\'{"method": "ngram", "num_speculative_tokens": 4}\'.'
        ) from e
    if not isinstance(value, dict):
        raise ConfigError("--speculative-config must be a JSON object.")
    return value


def _check_revision(model: str, revision: str | None) -> None:
    """`--revision` picks a commit of a hub model; a local folder, .gguf file or alias has none."""
    if revision is not None and (model.lower() in ALIASES or Path(model).expanduser().exists()):
        raise ConfigError(
            f"--revision {revision} applies to a Hugging Face hub id, but {model!r} is a local "
            "model (a folder, a .gguf file or an alias). Drop --revision, or name the hub id."
        )


def _auto_dtype(device: str) -> str:
    """bfloat16 on CUDA; float32 on the CPU: Transformers' reference precision for Hugging Face
    checkpoints, and for a quantized GGUF what our kernels take (as fast as bfloat16 there,
    `benchmarks/cpu_decode_step.py`, and a bfloat16 residual stream flips near-tied answers)."""
    return "bfloat16" if device == "cuda" else "float32"


def _resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for, but torch sees no CUDA device.")
    if device not in ("cuda", "cpu"):
        raise ConfigError(f"--device must be auto, cuda or cpu; got {device!r}.")
    return device


def _arg_type(type_name: str):
    if "int" in type_name:
        return int
    if "float" in type_name:
        return float
    return str


def _env_default(f: dataclasses.Field) -> Any:
    raw = envs.cli_default(f.name)
    assert raw is not None
    if f.type in ("bool", "bool | None"):
        return raw.lower() in ("1", "true", "yes", "on")
    try:
        if f.name in _PARSERS:
            return _PARSERS[f.name](raw)
        return _arg_type(str(f.type))(raw)
    except (ValueError, argparse.ArgumentTypeError) as e:  # ConfigError is a ValueError
        raise ConfigError(
            f"INFERENGINE_{f.name.upper()}={raw!r} is not a valid value ({e})."
        ) from e


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def _parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 2GiB, 512MB or 1000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


_PARSERS = {"kv_cache_memory": _parse_bytes, "speculative_config": _json_object}
