"""A mixture-of-experts model split over two CPU ranks (gloo): each rank holds half of every
expert's intermediate dimension. Greedy tokens equal one rank's and Transformers' through
chunked prefill, preemption and prefix hits, and the expert counts reach the engine."""

from __future__ import annotations

from inferengine import LLM
from tests.executor.test_parallel_engine import SETTINGS, _expected, _generate


def test_tp2_moe_greedy_matches_one_rank_and_transformers(tiny_checkpoint):
    # Qwen3-MoE: sparse layers 0 and 2 (8 experts, top-4), dense layer 1.
    path = str(tiny_checkpoint("qwen3-moe"))
    reference = LLM(path, **SETTINGS)
    one_rank = [o.outputs[0].token_ids for o in _generate(reference)]
    one_rank_counts = reference.llm_engine.core.expert_token_counts()
    llm = LLM(path, tensor_parallel_size=2, **SETTINGS)
    try:
        tokens = [o.outputs[0].token_ids for o in _generate(llm)]
        assert llm.llm_engine.core.scheduler.num_preemptions > 0
        assert tokens == one_rank == _expected(path)
        counts = llm.llm_engine.core.expert_token_counts()
        assert sorted(counts) == [0, 2]
        assert counts == one_rank_counts  # the same steps route the same tokens
    finally:
        llm.llm_engine.core.shutdown()
