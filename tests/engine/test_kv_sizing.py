"""Start-up sizing of the KV cache: an automatic max_model_len lowered to exactly what the pages
hold (one page is the null page), an explicit one refused with the numbers, and the CPU tier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inferengine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from inferengine.engine import kv_sizing
from inferengine.engine.kv_sizing import check_capacity, host_tier_size
from inferengine.errors import ConfigError


def model(max_model_len: int) -> ModelConfig:
    return ModelConfig("tiny", "/nonexistent", {"vocab_size": 320}, "float32", max_model_len)


def engine_config(
    max_model_len: int = 1024,
    auto: bool = True,
    block_size: int = 16,
    device: str = "cpu",
    draft: bool = False,
    **cache,
) -> EngineConfig:
    spec = None
    if draft:
        spec = SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=2)
        spec.draft_model_config = model(max_model_len)
    return EngineConfig(
        model_config=model(max_model_len),
        cache_config=CacheConfig(block_size=block_size, **cache),
        scheduler_config=SchedulerConfig(max_model_len=max_model_len, max_model_len_auto=auto),
        device=device,
        speculative_config=spec,
    )


@pytest.fixture
def warnings(monkeypatch) -> list[str]:
    said: list[str] = []  # the package logger does not propagate to caplog
    monkeypatch.setattr(kv_sizing.logger, "warning", lambda m, *a: said.append(m % a))
    return said


def test_an_automatic_max_model_len_is_lowered_to_the_tokens_the_pages_hold(warnings):
    config = engine_config(max_model_len=1024, block_size=16, draft=True)
    check_capacity(config, num_blocks=40)  # 39 usable pages of 16 tokens
    assert config.scheduler_config.max_model_len == 624
    assert config.model_config.max_model_len == 624
    assert config.speculative_config.draft_model_config.max_model_len == 624
    (warning,) = warnings
    assert warning.startswith(
        "the KV cache holds 624 tokens, fewer than the model's context length of 1024: "
        "max_model_len lowered to 624."
    )
    assert "--kv-cache-memory" in warning


def test_a_cache_that_holds_max_model_len_changes_nothing(warnings):
    config = engine_config(max_model_len=624, block_size=16)
    check_capacity(config, num_blocks=40)
    check_capacity(config, num_blocks=1000)
    assert config.scheduler_config.max_model_len == config.model_config.max_model_len == 624
    assert warnings == []


def test_an_explicit_max_model_len_is_never_lowered():
    config = engine_config(max_model_len=625, auto=False, block_size=16)
    with pytest.raises(ConfigError) as info:
        check_capacity(config, num_blocks=40)
    assert info.value.message == (
        "the KV cache holds 624 tokens (40 pages of 16), fewer than one request of "
        "--max-model-len 625. Lower --max-model-len to 624 or less, or give the cache more "
        "memory with --kv-cache-memory."
    )
    assert config.scheduler_config.max_model_len == 625


def test_on_a_gpu_the_memory_flag_named_is_gpu_memory_utilization():
    config = engine_config(max_model_len=100, auto=False, block_size=32, device="cuda")
    with pytest.raises(
        ConfigError,
        match=r"holds 64 tokens \(3 pages of 32\).*"
        r"--gpu-memory-utilization\.$",
    ):
        check_capacity(config, num_blocks=3)


@pytest.mark.parametrize("num_blocks", [0, 1])
def test_a_cache_with_no_usable_page_is_refused_even_when_automatic(num_blocks, warnings):
    config = engine_config(max_model_len=1024)
    with pytest.raises(ConfigError, match="the KV cache holds 0 tokens"):
        check_capacity(config, num_blocks=num_blocks)
    assert warnings == [] and config.scheduler_config.max_model_len == 1024


class FakeExecutor:
    def __init__(self, num_host_blocks: int, page_bytes: int = 4096):
        self.answer = (num_host_blocks, page_bytes)
        self.asked = 0

    def determine_num_host_blocks(self) -> tuple[int, int]:
        self.asked += 1
        return self.answer


@pytest.mark.parametrize(
    "cache",
    [{}, {"kv_offloading_size": 0.0}, {"kv_offloading_size": 1.0, "enable_prefix_caching": False}],
)
def test_no_cpu_tier_without_offloading_and_prefix_caching(cache):
    executor = FakeExecutor(10)
    assert host_tier_size(engine_config(**cache), executor) == (0, 0)
    assert executor.asked == 0  # nothing measured


def test_the_cpu_tier_gets_the_pages_the_workers_measured():
    executor = FakeExecutor(10, 8192)
    assert host_tier_size(engine_config(kv_offloading_size=0.5), executor) == (10, 8192)


def test_a_cpu_tier_too_small_for_one_page_is_refused():
    with pytest.raises(ConfigError) as info:
        host_tier_size(engine_config(kv_offloading_size=0.001), FakeExecutor(0, 2_000_000))
    assert info.value.message == (
        "--kv-offloading-size 0.001 GiB holds no KV page (a page takes 2000000 bytes over all "
        "ranks); give it more, or 0 to turn the CPU tier off."
    )


def test_lowering_without_a_draft_model():
    config = engine_config(max_model_len=512)
    config.speculative_config = SimpleNamespace(draft_model_config=None)  # ngram: no draft
    kv_sizing.lower_max_model_len(config, 100)
    assert (config.scheduler_config.max_model_len, config.model_config.max_model_len) == (100, 100)
