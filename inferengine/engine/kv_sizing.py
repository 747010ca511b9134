"""Start-up sizing of the KV cache for the engine core: whether the pages the workers measured
hold one request of `max_model_len` (lowering an automatic one to fit), and how many pages the
CPU tier gets."""

from __future__ import annotations

from typing import TYPE_CHECKING

from inferengine.config import EngineConfig
from inferengine.errors import ConfigError
from inferengine.logger import init_logger

if TYPE_CHECKING:
    from inferengine.executor.base import Executor

logger = init_logger(__name__)


def host_tier_size(config: EngineConfig, executor: Executor) -> tuple[int, int]:
    """Pages of the CPU tier and the bytes of one page over all ranks; (0, 0) without a tier."""
    cc = config.cache_config
    if not cc.kv_offloading_size or not cc.enable_prefix_caching:
        return 0, 0
    num_host_blocks, page_bytes = executor.determine_num_host_blocks()
    if num_host_blocks < 1:
        raise ConfigError(
            f"--kv-offloading-size {cc.kv_offloading_size} GiB holds no KV page (a page "
            f"takes {page_bytes} bytes over all ranks); give it more, or 0 to turn the "
            "CPU tier off."
        )
    logger.info(
        "CPU KV tier: %d pages (%d tokens)", num_host_blocks, num_host_blocks * cc.block_size
    )
    return num_host_blocks, page_bytes


def check_capacity(config: EngineConfig, num_blocks: int) -> None:
    """Refuse a cache that cannot hold one request of `max_model_len`; an automatic one (the
    model's context length) is lowered to what fits, with a warning."""
    cc, sc = config.cache_config, config.scheduler_config
    usable_tokens = max(0, num_blocks - 1) * cc.block_size
    flag = "--gpu-memory-utilization" if config.device == "cuda" else "--kv-cache-memory"
    if sc.max_model_len_auto and 0 < usable_tokens < sc.max_model_len:
        logger.warning(
            "the KV cache holds %d tokens, fewer than the model's context length of %d: "
            "max_model_len lowered to %d. For longer requests give the cache more memory "
            "with %s (and set --max-model-len).",
            usable_tokens,
            sc.max_model_len,
            usable_tokens,
            flag,
        )
        lower_max_model_len(config, usable_tokens)
    if usable_tokens < sc.max_model_len:
        raise ConfigError(
            f"the KV cache holds {usable_tokens} tokens ({num_blocks} pages of "
            f"{cc.block_size}), fewer than one request of --max-model-len "
            f"{sc.max_model_len}. Lower --max-model-len to {usable_tokens} or less, or "
            f"give the cache more memory with {flag}."
        )
    logger.info(
        "KV cache (%s): %d pages of %d tokens (%d tokens); up to %.1f requests of "
        "max_model_len=%d at once",
        cc.cache_dtype,
        num_blocks - 1,
        cc.block_size,
        usable_tokens,
        usable_tokens / sc.max_model_len,
        sc.max_model_len,
    )


def lower_max_model_len(config: EngineConfig, max_model_len: int) -> None:
    """Every config that carries it; the workers keep theirs, which only bounds buffers."""
    config.scheduler_config.max_model_len = max_model_len
    config.model_config.max_model_len = max_model_len
    spec = config.speculative_config
    if spec is not None and spec.draft_model_config is not None:
        spec.draft_model_config.max_model_len = max_model_len
