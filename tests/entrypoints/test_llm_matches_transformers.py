"""The engine's greedy outputs equal Transformers' token for token, for every architecture,
through chunked prefill, preemption, prefix caching on and off, and n=3."""

from __future__ import annotations

import functools

import pytest
import torch

from inferengine import LLM, SamplingParams
from tests.conftest import TINY_ARCHS, hf_greedy, hf_model

ARCHS = sorted(TINY_ARCHS)
LENGTHS = [1, 9, 16, 31, 64, 100, 170, 300]
MAX_TOKENS = [32, 5, 17, 1, 24, 12, 9, 20]


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in LENGTHS]


@functools.cache
def _expected(path: str) -> list[list[int]]:
    model = hf_model(path)
    return [hf_greedy(model, p, n) for p, n in zip(_prompts(), MAX_TOKENS, strict=True)]


def _params(n: int = 1) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, n=n) for m in MAX_TOKENS]


def _generate(llm: LLM, n: int = 1):
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    return llm.generate(prompts, _params(n), use_tqdm=False)


def _token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# Each mode is an engine setting that exercises one part of the scheduler.
MODES = {
    # A budget far below the longest prompt: every long prompt is prefilled in chunks.
    "chunked-prefill": dict(max_num_batched_tokens=40, long_prefill_token_threshold=24),
    # A page pool too small for all requests at once: requests get preempted and recomputed.
    "preemption": dict(num_gpu_blocks_override=24, max_num_batched_tokens=128, max_model_len=330),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    # The next step is scheduled before the last one's tokens are known.
    "async-scheduling-preemption": dict(
        async_scheduling=True,
        num_gpu_blocks_override=24,
        max_num_batched_tokens=96,
        max_model_len=330,
    ),
    # PyTorch FlexAttention over the pages instead of the torch reference, prefill in chunks.
    "flex-attention": dict(attention_backend="flex", max_num_batched_tokens=64),
}


def _llm(path, mode: str) -> LLM:
    return LLM(str(path), **{"max_model_len": 512, **MODES[mode]})


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(tiny_checkpoint, arch, mode):
    path = tiny_checkpoint(arch)
    llm = _llm(path, mode)
    outputs = _generate(llm)
    assert _token_ids(outputs) == _expected(str(path))
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    if "preemption" in mode:
        assert llm.llm_engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_second_pass_hits_and_matches(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    llm = LLM(str(path), max_model_len=512, enable_prefix_caching=True)
    first = _generate(llm)
    second = _generate(llm)
    assert _token_ids(first) == _token_ids(second) == _expected(str(path))
    # Every prompt of at least one full page and a bit finds its full pages cached.
    for length, output in zip(LENGTHS, second, strict=True):
        expected_hit = ((length - 1) // 16) * 16
        assert output.num_cached_tokens == expected_hit


@pytest.mark.parametrize("arch", ["llama3-tied", "qwen3"])
def test_n3_greedy_gives_three_identical_samples(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    llm = LLM(str(path), max_model_len=512)
    outputs = _generate(llm, n=3)
    for output, expected in zip(outputs, _expected(str(path)), strict=True):
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert all(c.token_ids == expected for c in output.outputs)
