"""Start-up refusals of `EngineArgs`: a split, a CPU tier or a fallback the model or the
machine cannot take, each a `ConfigError` that says what to change."""

from __future__ import annotations

import os

from inferengine.config import ModelConfig, ParallelConfig, SpeculativeConfig
from inferengine.errors import ConfigError
from inferengine.logger import init_logger

logger = init_logger(__name__)


def check_fallback(parallel: ParallelConfig, device: str, enforce_eager: bool) -> None:
    """The Transformers fallback runs on one device, without CUDA graphs."""
    if parallel.world_size > 1:
        raise ConfigError(
            "the Transformers fallback runs on one device: use --tensor-parallel-size 1 and "
            "--pipeline-parallel-size 1, or an architecture with a native implementation."
        )
    if device == "cuda" and not enforce_eager:
        logger.info(
            "the Transformers fallback runs eagerly (no CUDA graphs): Transformers' modeling "
            "code is not known to be free of host syncs, which a graph capture cannot take"
        )


def host_memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_offloading(
    size_gib: float | None, prefix_caching: bool, speculative: SpeculativeConfig | None
) -> None:
    """Refuse, at start-up, a CPU tier that cannot work (CacheConfig refuses a negative size)."""
    if not size_gib or size_gib < 0:
        return
    if not prefix_caching:
        raise ConfigError(
            "--kv-offloading-size keeps cached prefixes, so it needs prefix caching: drop "
            "--no-enable-prefix-caching or the offloading size."
        )
    if speculative is not None and speculative.method == "draft_model":
        raise ConfigError(
            "--kv-offloading-size does not work with a draft model yet; use the ngram or "
            "suffix method, or no CPU tier."
        )
    available = host_memory_available()
    if available is not None and size_gib * 2**30 > available:
        raise ConfigError(
            f"--kv-offloading-size {size_gib} GiB is more than this machine's available host "
            f"memory ({available / 2**30:.1f} GiB); give it at most that, less what the "
            "server itself needs."
        )


def check_parallel(
    parallel: ParallelConfig,
    model: ModelConfig,
    speculative: SpeculativeConfig | None,
    device: str,
    native: bool = True,
) -> None:
    """Refuse, at start-up, a split the model or the machine cannot take."""
    if native:  # the fallback runs unsplit (`check_fallback`)
        parallel.check_model(model)
    draft = speculative.draft_model_config if speculative is not None else None
    if draft is not None:
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError(
                "a draft model cannot run with --pipeline-parallel-size > 1 yet; use "
                "--tensor-parallel-size alone, or the ngram or suffix method."
            )
        parallel.check_model(draft, "the draft model")
    if device == "cuda" and parallel.distributed_executor_backend == "mp":  # Ray: its cluster's
        import torch

        have = torch.cuda.device_count()
        if parallel.world_size > have:
            raise ConfigError(
                f"--tensor-parallel-size × --pipeline-parallel-size is {parallel.world_size}, "
                f"but this machine has {have} GPU(s); lower them to fit."
            )
