"""`LoRAConfig` from the engine flags, and the combinations Multi-LoRA refuses at start-up."""

from __future__ import annotations

from typing import Any

from inferengine.config import LoRAConfig, ParallelConfig
from inferengine.errors import ConfigError

# Token proposers draft in the engine core, from token ids alone: they need no adapter.
SPECULATION_WITH_LORA = ("ngram", "suffix")


def lora_config_from_args(
    enable_lora: bool,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int | None,
    runtime_updates: bool,
    *,
    speculative: Any,
    parallel: ParallelConfig,
    device: str,
    enforce_eager: bool,
    native: bool,
    pooling: bool,
    kv_transfer: bool,
) -> LoRAConfig | None:
    """The LoRA config of `--enable-lora` (None without it); raises `ConfigError` for what is
    not built with adapters yet, naming the flag to drop."""
    if not enable_lora:
        if runtime_updates:
            raise ConfigError("--enable-runtime-lora serves adapter loading: add --enable-lora.")
        return None
    refusals = [
        (not native, "models run through the Transformers fallback (--model-impl transformers)"),
        (pooling, "pooling models (--runner pooling)"),
        (parallel.pipeline_parallel_size > 1, "--pipeline-parallel-size over 1"),
        (parallel.data_parallel_size > 1, "--data-parallel-size over 1"),
        (kv_transfer, "disaggregated prefill/decode (--kv-transfer-config)"),
        (
            device == "cuda" and not enforce_eager,
            "CUDA graphs (the batched LoRA kernels are not captured yet): add --enforce-eager",
        ),
        (
            speculative is not None and speculative.method not in SPECULATION_WITH_LORA,
            f"speculative method {getattr(speculative, 'method', None)!r} (a draft model "
            f"would draft without the adapter); {' or '.join(SPECULATION_WITH_LORA)} work",
        ),
    ]
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"--enable-lora is not built for {what} yet.")
    return LoRAConfig(max_loras, max_lora_rank, max_cpu_loras, runtime_updates)
