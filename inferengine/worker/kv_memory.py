"""How many KV pages fit: on the CPU what the running requests need (within a byte budget), on
CUDA what a profiling run leaves; and the page tensors (on the CPU, mapped lazily)."""

from __future__ import annotations

import gc
import math
import mmap
from collections.abc import Callable
from pathlib import Path

import torch

from inferengine.config import EngineConfig, ModelConfig
from inferengine.distributed.parallel_state import pp_layer_range
from inferengine.logger import init_logger

logger = init_logger(__name__)

_GIB = 1 << 30
# On the CPU the KV cache holds max_num_seqs requests of max_model_len, and PREFIX_CACHE_HEADROOM
# more for cached prefixes, but takes no more than this share of the memory still available once
# the weights are loaded, and never so much that less than CPU_HEADROOM_BYTES stays available.
# --kv-cache-memory overrides it; --gpu-memory-utilization is a share of device memory and
# applies to CUDA only.
PREFIX_CACHE_HEADROOM = 0.25
CPU_KV_FRACTION = 0.3
CPU_HEADROOM_BYTES = _GIB
FALLBACK_CPU_KV_BYTES = _GIB  # where the available memory cannot be read
# cgroup v2, then v1: (limit, usage) files, as a container sees its own group at the root.
_CGROUP_FILES = (
    ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current", "sys/fs/cgroup/memory.stat"),
    (
        "sys/fs/cgroup/memory/memory.limit_in_bytes",
        "sys/fs/cgroup/memory/memory.usage_in_bytes",
        "sys/fs/cgroup/memory/memory.stat",
    ),
)


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


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype KV pages are stored in: the model's, or fp8 with --kv-cache-dtype."""
    from inferengine.kernels.kv_quant import cache_torch_dtype
    from inferengine.model.loader.loader import TORCH_DTYPES

    model_dtype = TORCH_DTYPES[config.model_config.dtype]
    return cache_torch_dtype(config.cache_config.cache_dtype, model_dtype)


def kv_block_bytes(config: EngineConfig, dtype: torch.dtype) -> int:
    """Bytes of one page across this rank's layers (K and V, its share of the KV heads), the
    draft model's layers included; `dtype` is the cache's (`kv_cache_dtype`)."""
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
    `model_config` (default: the target), all zeros."""
    m = model_config or config.model_config
    shape = (2, num_blocks, config.cache_config.block_size, _kv_heads(m, config), m.head_dim)
    if device.type == "cpu":
        return [lazy_zeros(shape, dtype) for _ in range(_num_layers(m))]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(_num_layers(m))]


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous memory map: the OS hands out its zero pages as
    they are first written, so the process's resident memory grows with the KV pages in use,
    not with the cache's size."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes)  # private, anonymous: zero-filled, kept alive by the tensor
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


def runs_eagerly(config: EngineConfig) -> bool:
    """No CUDA graphs will be captured: asked for, or a pipeline stage (its step waits on
    another process's activations)."""
    return config.enforce_eager or config.parallel_config.pipeline_parallel_size > 1


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # missing, or "max" (no limit)
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def host_memory_available(root: str | Path = "/") -> int | None:
    """Bytes of host memory this process can still take: /proc/meminfo's MemAvailable, or
    less where a cgroup (a container's memory limit) leaves less. None: unknown."""
    root = Path(root)
    available = None
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file, stat_file in _CGROUP_FILES:
        limit, usage = _read_int(root / limit_file), _read_int(root / usage_file)
        if limit is None or usage is None or limit >= 1 << 60:  # v1 writes "no limit" as ~2^63
            continue
        # Usage counts page cache; its inactive part is reclaimed before the limit bites.
        left = max(0, limit - usage + _stat_value(root / stat_file, "inactive_file"))
        available = left if available is None else min(available, left)
    return available


def cpu_kv_budget(available: int | None, share: float = 1.0) -> tuple[int, str]:
    """The default CPU KV cache bytes for one rank holding `share` of the cache, given the
    host memory still available, and why."""
    if available is None:
        return int(FALLBACK_CPU_KV_BYTES * share), "available host memory unknown"
    budget = max(0, min(available * CPU_KV_FRACTION, available - CPU_HEADROOM_BYTES))
    why = (
        f"{CPU_KV_FRACTION:g} of the {available / _GIB:.1f} GiB available after loading the "
        f"weights, leaving at least {CPU_HEADROOM_BYTES / _GIB:g} GiB"
    )
    return int(budget * share), why


def cpu_kv_pages(
    page_bytes: int,
    budget: int,
    budget_why: str,
    max_num_seqs: int,
    max_model_len: int,
    block_size: int,
) -> tuple[int, str]:
    """The default CPU KV pages, and why: a page for every token of max_num_seqs requests of
    max_model_len, PREFIX_CACHE_HEADROOM more for cached prefixes, and the null page; fewer
    where `budget` bytes hold fewer."""
    running = max_num_seqs * -(-max_model_len // block_size)
    headroom = math.ceil(running * PREFIX_CACHE_HEADROOM)
    need = running + headroom + 1
    requests = f"max_num_seqs={max_num_seqs} requests of max_model_len={max_model_len}"
    fits = budget // page_bytes
    if need <= fits:
        return need, f"{requests}: {running} pages, {headroom} more for cached prefixes"
    return fits, (
        f"{budget_why}; {requests} would take {need} pages ({need * page_bytes / _GIB:.2f} GiB)"
    )


def num_blocks_for_cpu(config: EngineConfig, dtype: torch.dtype) -> int:
    """Pages in --kv-cache-memory, or by default what `cpu_kv_pages` gives within a share of
    the host memory available now (the weights are loaded; the ranks of a split model share
    it)."""
    page_bytes = kv_block_bytes(config, dtype)
    cc, sc = config.cache_config, config.scheduler_config
    if cc.kv_cache_memory:
        pages, why = cc.kv_cache_memory // page_bytes, "--kv-cache-memory"
    else:
        world_size = config.parallel_config.world_size
        budget, budget_why = cpu_kv_budget(host_memory_available(), 1 / world_size)
        pages, why = cpu_kv_pages(
            page_bytes, budget, budget_why, sc.max_num_seqs, sc.max_model_len, cc.block_size
        )
        why += "; --kv-cache-memory sets it"
    logger.info(
        "CPU KV cache: %d pages of %d tokens, %.2f GiB, resident as they fill (%s)",
        pages,
        cc.block_size,
        pages * page_bytes / _GIB,
        why,
    )
    return pages


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
