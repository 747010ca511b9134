"""`--kv-cache-dtype fp8` end to end on a CUDA GPU (Triton kernels, CUDA graphs): bfloat16 pages
halve, both under a byte budget and under --gpu-memory-utilization; next-token choices agree
with the bfloat16 cache and with the torch reference backend over the same fp8 cache.

Tiny random checkpoints only (the machine reaches no model hub): the >= 99% agreement of the
issue is for real models, measured by the paired benchmark against vLLM."""

from __future__ import annotations

import gc

import pytest
import torch

from inferengine import LLM
from tests.engine.test_fp8_kv_cache import agreement, argmax_per_position, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
COMMON = dict(max_model_len=1024, dtype="bfloat16", device="cuda")


def run(path: str, token_lists: list[list[int]], **settings) -> tuple[list[int], int]:
    """The next-token argmax at every prompt position, and the engine's KV pages."""
    llm = LLM(path, **{**COMMON, **settings})
    try:
        worker = llm.llm_engine.core.executor.worker
        if settings.get("attention_backend", "auto") == "auto":
            assert worker.attn_backend.name == "triton"
            assert worker.runner.graphs is not None and worker.runner.graphs.graphs
        pages = llm.llm_engine.core.config.cache_config.num_blocks
        return argmax_per_position(llm, token_lists), pages
    finally:
        llm.llm_engine.core.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["qwen3", "mistral-window", "gemma2", "llama3-tied"])
def test_fp8_on_the_gpu(tiny_checkpoint, arch):
    path = str(tiny_checkpoint(arch))
    token_lists = prompts(11, lengths=(40, 90, 300, 700, 17))
    memory = dict(kv_cache_memory=64 << 20)
    bf16, bf16_pages = run(path, token_lists, **memory)
    fp8, fp8_pages = run(path, token_lists, kv_cache_dtype="fp8", **memory)
    reference, _ = run(
        path, token_lists, kv_cache_dtype="fp8", attention_backend="torch", enforce_eager=True,
        **memory,
    )  # fmt: skip
    assert fp8_pages // bf16_pages == 2
    # On the CPU (torch backend, bfloat16) these models agree at 92-96% of positions.
    assert agreement(fp8, bf16) >= 0.85
    # The same fp8 values; bfloat16 arithmetic in another order flips only near-ties.
    assert agreement(fp8, reference) >= 0.95


def test_measured_memory_holds_twice_the_pages(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    token_lists = prompts(12, lengths=(30,))
    _, bf16_pages = run(path, token_lists, gpu_memory_utilization=0.3)
    _, fp8_pages = run(path, token_lists, gpu_memory_utilization=0.3, kv_cache_dtype="fp8")
    assert 1.9 <= fp8_pages / bf16_pages <= 2.1
