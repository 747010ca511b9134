"""How many KV pages fit: a byte budget on the CPU, a profiling run on CUDA."""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

from inferengine.config import EngineConfig, ModelConfig
from inferengine.distributed.parallel_state import pp_layer_range
from inferengine.logger import init_logger

logger = init_logger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
_GIB = 1 << 30


def _kv_heads(m: ModelConfig, config: EngineConfig) -> int:
    return max(1, m.num_kv_heads // config.parallel_config.tensor_parallel_size)


def _num_layers(m: ModelConfig) -> int:
    """Layers of `m` on this pipeline stage."""
    start, end = pp_layer_range(m.num_layers)
    return end - start


def _models(config: EngineConfig) -> list[ModelConfig]:
    """The target, and a draft model when one speculates: its pages share the target's ids."""
    spec = config.speculative_config
    draft = spec.draft_model_config if spec is not None else None
    return [config.model_config] if draft is None else [config.model_config, draft]


def kv_block_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of one page across this rank's layers (K and V, its share of the KV heads), the
    draft model's layers included."""
    per_token = sum(
        2 * _num_layers(m) * _kv_heads(m, config) * m.head_dim * dtype.itemsize
        for m in _models(config)
    )
    return per_token * config.cache_config.block_size


def allocate_kv_caches(
    config: EngineConfig,
    num_blocks: int,
    dtype: torch.dtype,
    device: torch.device,
    model_config: ModelConfig | None = None,
) -> list[torch.Tensor]:
    """One `[2, num_blocks, block_size, kv_heads, head_dim]` tensor per layer of
    `model_config` (default: the target)."""
    m = model_config or config.model_config
    shape = (2, num_blocks, config.cache_config.block_size, _kv_heads(m, config), m.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(_num_layers(m))]


def runs_eagerly(config: EngineConfig) -> bool:
    """No CUDA graphs will be captured: asked for, or a pipeline stage (its step waits on
    another process's activations)."""
    return config.enforce_eager or config.parallel_config.pipeline_parallel_size > 1


def num_blocks_for_cpu(config: EngineConfig, dtype: torch.dtype) -> int:
    budget = config.cache_config.kv_cache_memory or DEFAULT_CPU_KV_BYTES
    return budget // kv_block_bytes(config, dtype)


def num_blocks_for_cuda(
    config: EngineConfig, dtype: torch.dtype, device: torch.device, profile: Callable[[], None]
) -> int:
    """Run `profile` (a forward pass at the largest batch, plus sampling) and give the KV cache
    what is left of `gpu_memory_utilization` × the device's memory."""
    if config.cache_config.kv_cache_memory:
        return config.cache_config.kv_cache_memory // kv_block_bytes(config, dtype)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    profile()
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_allocated(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    graph_reserve = 0 if runs_eagerly(config) else _GIB  # graph pools, mixed steps included
    budget = total * config.cache_config.gpu_memory_utilization - peak - non_torch - graph_reserve
    logger.info(
        "memory: total %.1f GiB, peak in profile run %.2f GiB, outside torch %.2f GiB, "
        "left for the KV cache %.2f GiB",
        total / _GIB,
        peak / _GIB,
        non_torch / _GIB,
        max(budget, 0) / _GIB,
    )
    torch.cuda.empty_cache()
    return max(0, int(budget // kv_block_bytes(config, dtype)))
