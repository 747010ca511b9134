"""The CPU tier on CUDA (`pytest -m gpu`): pages saved to pinned host memory on the side stream
and loaded back give the greedy tokens of an engine without the tier (bf16 and float32, CUDA
graphs on), and float32 tokens equal Transformers'."""

from __future__ import annotations

import pytest
import torch
from test_kv_offload import SETTINGS, _turns

from inferengine import LLM
from tests.conftest import hf_greedy, hf_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _run(path: str, dtype: str, offload: float | None):
    llm = LLM(path, dtype=dtype, device="cuda", gpu_memory_utilization=0.3,
              kv_offloading_size=offload, **SETTINGS)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    first = torch.randint(2, 320, (70,), generator=g).tolist()
    fillers = [torch.randint(2, 320, (120,), generator=g).tolist() for _ in range(2)]
    second, one, two, out = _turns(llm, first, fillers)
    tiers = llm.llm_engine.core.scheduler.make_stats().kv_tiers
    return first, second, one, two, out, tiers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "llama3-tied"])
def test_cpu_tier_round_trip_keeps_tokens_on_cuda(tiny_checkpoint, arch, dtype):
    path = str(tiny_checkpoint(arch))
    first, second, one, two, out, tiers = _run(path, dtype, 0.002)
    _, _, plain_one, plain_two, plain_out, _ = _run(path, dtype, None)
    assert (one, two) == (plain_one, plain_two)
    assert tiers.cpu_hit_tokens >= 64 and out.num_cached_tokens >= 64
    assert plain_out.num_cached_tokens == 0
    if dtype == "float32":
        model = hf_model(path)
        assert one == hf_greedy(model, first, 8) and two == hf_greedy(model, second, 8)
