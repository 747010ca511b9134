"""The CPU tier end to end: pages go GPU (here: the device pool) -> host -> pool and greedy
tokens stay Transformers' own, on one rank and on two; the worker's copies move exact bytes."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.errors import ConfigError
from inferengine.worker.kv_offload import HostKVTier
from tests.conftest import hf_greedy, hf_model

# 12 pages of 16 tokens: one conversation of ~100 tokens fits, but not beside the fillers.
SETTINGS = dict(max_model_len=176, num_gpu_blocks_override=12, enable_prefix_caching=True)
OFFLOAD_GIB = 0.002


def _turns(llm: LLM, first: list[int], fillers: list[list[int]]):
    """Turn 1, then fillers that push turn 1's pages out of the pool, then turn 2 (turn 1's
    prompt and answer plus a tool output)."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (one,) = llm.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)
    for filler in fillers:
        llm.generate([{"prompt_token_ids": filler}], greedy, use_tqdm=False)
    second = [*first, *one.outputs[0].token_ids, *range(200, 240)]
    (two,) = llm.generate([{"prompt_token_ids": second}], greedy, use_tqdm=False)
    return second, list(one.outputs[0].token_ids), list(two.outputs[0].token_ids), two


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)])
def test_pages_back_from_the_cpu_tier_give_the_same_tokens(tiny_checkpoint, tp, pp):
    path = str(tiny_checkpoint("qwen3"))
    g = torch.Generator().manual_seed(5)
    first = torch.randint(2, 320, (70,), generator=g).tolist()
    fillers = [torch.randint(2, 320, (120,), generator=g).tolist() for _ in range(2)]
    llm = LLM(
        path,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        kv_offloading_size=OFFLOAD_GIB,
        **SETTINGS,
    )
    try:
        second, one, two, out = _turns(llm, first, fillers)
        tiers = llm.llm_engine.core.scheduler.make_stats().kv_tiers
    finally:
        llm.llm_engine.core.shutdown()
    model = hf_model(path)
    assert one == hf_greedy(model, first, 8)
    assert two == hf_greedy(model, second, 8)
    # Turn 2 found turn 1's prompt pages only on the host (the fillers took the pool).
    assert tiers.cpu_hit_tokens >= 64 and tiers.loaded_blocks >= 4
    assert out.num_cached_tokens >= 64
    assert tiers.offloaded_bytes == tiers.offloaded_blocks * llm.llm_engine.core.kv_page_bytes > 0


def test_without_the_tier_the_same_turn_is_recomputed(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    g = torch.Generator().manual_seed(5)
    first = torch.randint(2, 320, (70,), generator=g).tolist()
    fillers = [torch.randint(2, 320, (120,), generator=g).tolist() for _ in range(2)]
    llm = LLM(path, **SETTINGS)
    _, _, _, out = _turns(llm, first, fillers)
    assert out.num_cached_tokens == 0


def test_host_tier_copies_exact_pages():
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 6, 4, 2, 8, generator=g) for _ in range(3)]
    tier = HostKVTier(caches, num_slots=4)
    before = [c.clone() for c in caches]
    tier.copy(caches, offloads=[(5, 0), (2, 3)], loads=[])
    for c, h in zip(before, tier.host, strict=True):
        assert torch.equal(h[:, 0], c[:, 5]) and torch.equal(h[:, 3], c[:, 2])
    # Offloads run before loads: page 5 is saved to slot 1, then overwritten from slot 0.
    tier.copy(caches, offloads=[(5, 1)], loads=[(3, 5), (0, 1)])
    for c, b, h in zip(caches, before, tier.host, strict=True):
        assert torch.equal(h[:, 1], b[:, 5])
        assert torch.equal(c[:, 5], b[:, 2]) and torch.equal(c[:, 1], b[:, 5])


def test_an_offload_size_beyond_host_memory_is_refused(tiny_checkpoint):
    with pytest.raises(ConfigError, match="more than this machine's available host memory"):
        LLM(str(tiny_checkpoint("qwen3")), kv_offloading_size=1e6, max_model_len=128)
    with pytest.raises(ConfigError, match="0 or more"):
        LLM(str(tiny_checkpoint("qwen3")), kv_offloading_size=-1, max_model_len=128)
    with pytest.raises(ConfigError, match="needs prefix caching"):
        LLM(
            str(tiny_checkpoint("qwen3")),
            kv_offloading_size=0.01,
            enable_prefix_caching=False,
            max_model_len=128,
        )
