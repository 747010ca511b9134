"""Speculation on CUDA (`pytest -m gpu`): float32 greedy tokens equal plain decoding's with CUDA
graphs on (verify steps replay the verify graphs), in mixed batches with chunked prefill and
preemption, for the n-gram and the draft-model methods."""

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
    kinds = []
    graphs = llm.llm_engine.core.executor.worker.runner.graphs
    replay = graphs.replay

    def counting_replay(shape):
        kinds.append(shape.kind)
        return replay(shape)

    graphs.replay = counting_replay
    outputs = llm.generate(prompts, params, use_tqdm=False)
    scheduler = llm.llm_engine.core.scheduler
    if spec is not None and scheduler.spec_stats.num_drafts:
        assert "verify" in kinds  # drafts were verified in captured graphs
    return [[c.token_ids for c in o.outputs] for o in outputs], scheduler


@pytest.mark.parametrize("kwargs", [{}, {"max_num_batched_tokens": 40},
                                    {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 64}])  # fmt: skip
@pytest.mark.parametrize("arch", ["llama3-tied", "qwen2"])
def test_ngram_greedy_matches_plain_decoding_on_cuda(tiny_checkpoint, arch, kwargs):
    path = str(tiny_checkpoint(arch))
    plain, _ = _tokens(path, None, **kwargs)
    spec, scheduler = _tokens(path, SPEC, **kwargs)
    assert spec == plain
    assert scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize(
    "kwargs", [{}, {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 64}]
)
def test_draft_model_greedy_matches_plain_decoding_on_cuda(tiny_checkpoint, kwargs):
    target = str(tiny_checkpoint("qwen2"))
    draft = {"method": "draft_model", "model": str(tiny_checkpoint("llama3-tied")),
             "num_speculative_tokens": 3}  # fmt: skip
    plain, _ = _tokens(target, None, **kwargs)
    spec, scheduler = _tokens(target, draft, **kwargs)
    assert spec == plain
    assert scheduler.spec_stats.num_drafts > 0


def test_target_as_its_own_draft_model_on_cuda(tiny_checkpoint):
    target = str(tiny_checkpoint("llama3-tied"))
    plain, _ = _tokens(target, None)
    own = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
    spec, scheduler = _tokens(target, own)
    assert spec == plain
    stats = scheduler.spec_stats
    assert stats.num_draft_tokens > 50 and stats.num_accepted_tokens == stats.num_draft_tokens
