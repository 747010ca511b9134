"""Worker on the CPU over a tiny qwen2 (2 layers, 4 heads of 16 dims, 2 KV heads): the attention
shape it asks a backend for, the pages it sizes (default, override, CPU tier), the caches it
allocates, and a step through the real model."""

from __future__ import annotations

import pytest
import torch

from inferengine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from inferengine.engine.arg_utils import EngineArgs
from inferengine.sampling_params import SamplingParams
from inferengine.worker import kv_memory
from inferengine.worker.worker import Worker

PAGE_BYTES = 8192  # 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes x 16 tokens


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    args = EngineArgs(
        model=str(tiny_checkpoint("qwen2")),
        device="cpu",
        dtype="float32",
        max_model_len=128,
        max_num_seqs=4,
        kv_offloading_size=0.001,
    )
    return Worker(args.create_engine_config())


def test_attention_shape(worker):
    shape = worker.attention_shape()
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (4, 2, 16)
    assert shape.block_size == 16 and shape.dtype == torch.float32
    assert shape.kv_cache_dtype == torch.float32 and shape.sliding_window is None
    assert worker.device == torch.device("cpu") and worker.draft_config is None


def test_pages_sized_by_default_by_override_and_for_the_cpu_tier(worker, monkeypatch):
    monkeypatch.setattr(kv_memory, "host_memory_available", lambda: 64 << 30)
    # 4 requests of 128 tokens: 32 pages, 8 more for cached prefixes, the null page.
    assert worker.determine_num_blocks() == 41
    monkeypatch.setattr(worker.config.cache_config, "num_gpu_blocks_override", 7)
    assert worker.determine_num_blocks() == 7
    # 0.001 GiB of host memory in pages of 8 KiB.
    assert worker.determine_num_host_blocks() == (int(0.001 * 2**30 // PAGE_BYTES), PAGE_BYTES)
    assert worker.determine_num_host_blocks()[0] == 131


def test_caches_and_a_step_through_the_model(worker):
    worker.initialize_cache(num_blocks=10, num_host_blocks=3)
    runner = worker.runner
    assert [tuple(c.shape) for c in runner.kv_caches] == [(2, 10, 16, 2, 16)] * 2
    assert runner.host_tier is not None and tuple(runner.host_tier.host.shape) == (3, PAGE_BYTES)
    assert runner.graphs is None  # no CUDA graphs on the CPU
    assert worker.expert_token_counts() == {}  # a dense model

    greedy = SamplingParams(temperature=0.0)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    first = worker.execute_model(
        SchedulerOutput(
            [NewRequestData("r", prompt, [], greedy, None, [1, 2], 0)], [], {"r": 18}, 18
        )
    )
    (token,) = first.sampled_token_ids[0]
    assert 0 <= token < 320
    assert runner.kv_caches[0][:, 1].abs().sum() > 0 and runner.kv_caches[0][:, 2, :2].any()
    assert not runner.kv_caches[0][:, 2, 2:].any() and not runner.kv_caches[0][:, 3].any()
    # Pages 1 and 2 go to the CPU tier before the next step; the decode writes position 18.
    second = worker.execute_model(
        SchedulerOutput(
            [], [CachedRequestData("r", [], 18)], {"r": 1}, 1, kv_offloads=[(1, 0), (2, 2)]
        )
    )
    assert len(second.sampled_token_ids[0]) == 1
    tier = runner.host_tier
    for layer, cache in enumerate(runner.kv_caches):
        assert torch.equal(tier.page(layer, 0), cache[:, 1])
        assert torch.equal(tier.page(layer, 2)[:, :2], cache[:, 2, :2])  # saved before the step
    assert runner.kv_caches[0][:, 2, 2].any()  # position 18 written by the decode
    # The same prompt in a fresh row gives the same first token (the step is deterministic).
    again = worker.execute_model(
        SchedulerOutput(
            [NewRequestData("s", prompt, [], greedy, None, [4, 5], 0)], [], {"s": 18}, 18,
            finished_req_ids={"r"},
        )
    )  # fmt: skip
    assert again.sampled_token_ids == [[token]]
