"""N-gram speculation on CUDA (`pytest -m gpu`): float32 greedy tokens equal plain decoding's
with CUDA graphs on (verify steps replay the mixed graphs), in mixed batches with chunked
prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from test_ngram_engine import SPEC, _requests

from inferengine import LLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _tokens(path: str, spec: dict | None, **kwargs) -> tuple[list, object]:
    llm = LLM(path, max_model_len=256, dtype="float32", device="cuda", speculative_config=spec,
              gpu_memory_utilization=0.3, **kwargs)  # fmt: skip
    prompts, params = _requests()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outputs], llm.llm_engine.core.scheduler


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 40},
                                    {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 64}])  # fmt: skip
@pytest.mark.parametrize("arch", ["llama3-tied", "qwen2"])
def test_ngram_greedy_matches_plain_decoding_on_cuda(tiny_checkpoint, arch, kwargs):
    path = str(tiny_checkpoint(arch))
    plain, _ = _tokens(path, None, **kwargs)
    spec, scheduler = _tokens(path, SPEC, **kwargs)
    assert spec == plain
    assert scheduler.spec_stats.num_accepted_tokens > 0
