"""Async scheduling (step N+1 scheduled before step N's tokens are known) changes no output."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams


def _requests():
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 20, 45, 90, 7, 33)]
    params = [
        SamplingParams(temperature=0, max_tokens=25),
        SamplingParams(temperature=1.0, seed=11, max_tokens=18, top_k=20),
        SamplingParams(temperature=0.8, seed=5, top_p=0.9, max_tokens=30, presence_penalty=1.0),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=10, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, seed=3, max_tokens=22, frequency_penalty=0.5, n=2),
        SamplingParams(temperature=0, max_tokens=40, logprobs=2, stop_token_ids=[17, 18]),
    ]
    return [{"prompt_token_ids": p} for p in prompts], params


@pytest.mark.parametrize("arch", ["llama3-tied", "qwen2"])
def test_async_scheduling_matches_sync(tiny_checkpoint, arch):
    path = str(tiny_checkpoint(arch))
    prompts, params = _requests()
    results = {}
    for mode in (False, True):
        llm = LLM(path, max_model_len=256, max_num_batched_tokens=64, async_scheduling=mode)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = [
            [(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outputs
        ]
        core = llm.llm_engine.core
        for _ in range(3):  # collect a step launched before the last requests were known done
            if core.has_unfinished_requests():
                core.step()
        assert not core.has_unfinished_requests()
        assert (
            core.scheduler.kv_cache_manager.pool.num_free_blocks
            == core.scheduler.kv_cache_manager.pool.num_usable_blocks
        )
    assert results[True] == results[False]
