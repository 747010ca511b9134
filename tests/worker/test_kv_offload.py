"""The CPU tier end to end: pages go GPU (here: the device pool) -> host -> pool and greedy
tokens stay Transformers' own, on one rank and on two; the worker's copies move exact bytes."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.errors import ConfigError
from inferengine.worker import kv_offload
from inferengine.worker.kv_offload import HostKVTier, read_pages
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


def _devices():
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_host_tier_copies_exact_pages(monkeypatch, device, dtype):
    # Two pages of staging on the GPU, so saves and loads of three pages run in chunks.
    monkeypatch.setattr(kv_offload, "STAGING_BYTES", 2 * 3 * (2 * 4 * 2 * 8) * dtype.itemsize)
    g = torch.Generator().manual_seed(0)
    caches = [
        torch.randn(2, 6, 4, 2, 8, generator=g).to(device=device, dtype=dtype) for _ in range(3)
    ]
    tier = HostKVTier(caches, num_slots=5)
    before = [c.clone() for c in caches]

    def host_page(layer, slot):
        torch.cuda.synchronize() if device == "cuda" else None
        return tier.page(layer, slot).to(device)

    tier.copy(caches, offloads=[(5, 0), (2, 3), (4, 1)], loads=[])
    for i, c in enumerate(before):
        for page, slot in [(5, 0), (2, 3), (4, 1)]:
            assert torch.equal(host_page(i, slot).view(torch.uint8), c[:, page].view(torch.uint8))
    # Offloads run before loads: page 5 is saved to slot 2, then overwritten from slot 0;
    # the write-back of page 3 saves what the page held before this step.
    tier.copy(caches, offloads=[(5, 2)], loads=[(3, 5), (0, 1), (1, 0)], writebacks=[(3, 4)])
    for i, (c, b) in enumerate(zip(caches, before, strict=True)):
        assert torch.equal(host_page(i, 2).view(torch.uint8), b[:, 5].view(torch.uint8))
        assert torch.equal(host_page(i, 4).view(torch.uint8), b[:, 3].view(torch.uint8))
        for page, source in [(5, 2), (1, 5), (0, 4)]:
            assert torch.equal(c[:, page].view(torch.uint8), b[:, source].view(torch.uint8))
        assert torch.equal(c[:, 3].view(torch.uint8), b[:, 3].view(torch.uint8))


@pytest.mark.parametrize("device", _devices())
def test_concurrent_conversations_through_a_small_pool_keep_tokens(tiny_checkpoint, device):
    """Eight conversations at once through 20 pages: steps save, write back and load pages
    while other requests decode (on CUDA: async scheduling, graphs, the side stream), and
    every turn's greedy tokens equal an engine's without the tier. float32: with the tier a
    turn reads K/V its earlier decode steps wrote, without it a prefill recomputes them, and
    a random tiny model's near-ties can flip on that difference in bf16."""
    path = str(tiny_checkpoint("qwen3"))
    g = torch.Generator().manual_seed(9)
    firsts = [torch.randint(2, 320, (40 + 9 * i,), generator=g).tolist() for i in range(8)]

    def run(offload: float | None):
        extra = dict(gpu_memory_utilization=0.3) if device == "cuda" else {}
        llm = LLM(path, device=device, dtype="float32", max_model_len=176, num_gpu_blocks_override=20,
                  enable_prefix_caching=True, kv_offloading_size=offload, **extra)  # fmt: skip
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompts, answers = [list(f) for f in firsts], []
        try:
            for turn in range(3):
                outs = llm.generate(
                    [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False
                )
                answers.append([list(o.outputs[0].token_ids) for o in outs])
                tool = list(range(200 + turn, 216 + turn))
                prompts = [[*p, *a, *tool] for p, a in zip(prompts, answers[-1], strict=True)]
            return answers, llm.llm_engine.core.scheduler.make_stats().kv_tiers
        finally:
            llm.llm_engine.core.shutdown()

    with_tier, tiers = run(0.004)
    without, _ = run(None)
    assert with_tier == without
    assert tiers.loaded_blocks > 0 and tiers.offloaded_blocks > 0 and tiers.cpu_hit_tokens > 0


def test_runs_of_consecutive_slots():
    assert kv_offload._runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert kv_offload._runs([]) == []


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


def _cpu_caches(seed: int = 0) -> list[torch.Tensor]:
    """Two layers of 6 pages (block 4), the second with twice the KV heads."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 6, 4, heads, 8, generator=g) for heads in (1, 2)]


def test_a_slot_holds_one_page_of_every_layer_back_to_back():
    caches = _cpu_caches()
    tier = HostKVTier(caches, num_slots=3)
    assert tier.page_bytes == [2 * 4 * 1 * 8 * 4, 2 * 4 * 2 * 8 * 4]  # 256 and 512 bytes
    assert tier.offsets == [0, 256] and tier.slot_bytes == 768
    assert tier.host.shape == (3, 768) and tier.host.dtype == torch.uint8
    assert tier.stream is None and tier.staging is None  # CPU: copies go straight to slots
    tier.copy(caches, offloads=[(4, 2)], loads=[])
    assert torch.equal(tier.host[2, :256].view(torch.float32).view(2, 4, 1, 8), caches[0][:, 4])
    assert torch.equal(tier.host[2, 256:].view(torch.float32).view(2, 4, 2, 8), caches[1][:, 4])
    assert tier.page(1, 2).shape == (2, 4, 2, 8) and tier.page(1, 2).dtype == torch.float32


def test_a_step_without_copies_changes_nothing():
    caches = _cpu_caches()
    tier = HostKVTier(caches, num_slots=3)
    tier.host.fill_(7)
    before = [c.clone() for c in caches]
    tier.copy(caches, offloads=[], loads=[], writebacks=[])
    assert all(torch.equal(c, b) for c, b in zip(caches, before, strict=True))
    assert bool((tier.host == 7).all())


def test_imported_pages_are_written_to_their_slots_and_read_back_with_gpu_pages():
    caches = _cpu_caches()
    tier = HostKVTier(caches, num_slots=4)
    imported = _cpu_caches(seed=1)  # pages 0 and 1 of another rank's cache, as [2, n, ...]
    tier.write([3, 1], [c[:, :2] for c in imported])
    for layer in (0, 1):
        assert torch.equal(tier.page(layer, 3), imported[layer][:, 0])
        assert torch.equal(tier.page(layer, 1), imported[layer][:, 1])
    # Pages in the asked order, wherever each one lies.
    out = read_pages(caches, tier, [("host", 1), ("gpu", 5), ("host", 3)])
    for layer in (0, 1):
        assert out[layer].shape == (2, 3, 4, layer + 1, 8)
        assert torch.equal(out[layer][:, 0], imported[layer][:, 1])
        assert torch.equal(out[layer][:, 1], caches[layer][:, 5])
        assert torch.equal(out[layer][:, 2], imported[layer][:, 0])
    assert [o.shape[1] for o in read_pages(caches, None, [("gpu", 0)])] == [1, 1]
    with pytest.raises(AssertionError, match="cache's dtype"):
        tier.write([0], [c[:, :1].to(torch.bfloat16) for c in imported])


def test_loaded_pages_overwrite_only_their_targets():
    caches = _cpu_caches()
    tier = HostKVTier(caches, num_slots=4)
    before = [c.clone() for c in caches]
    tier.copy(caches, offloads=[(0, 0), (1, 1)], loads=[])
    tier.copy(caches, offloads=[], loads=[(1, 4), (0, 5)])
    for c, b in zip(caches, before, strict=True):
        assert torch.equal(c[:, 4], b[:, 1]) and torch.equal(c[:, 5], b[:, 0])
        assert torch.equal(c[:, :4], b[:, :4])
