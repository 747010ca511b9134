"""Suffix speculation through the engine: greedy tokens equal plain decoding's (mixed batches,
chunked prefill, preemption, prefix hits), and a request that repeats an earlier request's
answer drafts from the cache of finished requests."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from tests.spec_decode.test_ngram_engine import _run

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 16}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_batched_tokens": 2048},
        {"max_num_batched_tokens": 40},
        {"max_num_batched_tokens": 64, "num_gpu_blocks_override": 24},
    ],
)
def test_suffix_greedy_matches_plain_decoding(tiny_checkpoint, kwargs):
    path = str(tiny_checkpoint("qwen2"))
    plain, _, _, _ = _run(path, None, **kwargs)
    spec, _, stats, drafted_ahead = _run(path, SUFFIX, **kwargs)
    assert spec == plain
    assert drafted_ahead > 0
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_finished_requests_reach_the_cache_with_their_whole_text(tiny_checkpoint, monkeypatch):
    """The engine hands each finished request's final tokens and prompt length to the suffix
    proposer (whose cache of finished requests the unit tests check), and the cache then drafts
    the answer for a new request that starts it again."""
    from inferengine.spec_decode.suffix import SuffixProposer

    seen = []
    finish = SuffixProposer.finish

    def spy(self, request_id, token_ids=None, num_prompt_tokens=0):
        seen.append((list(token_ids), num_prompt_tokens))
        return finish(self, request_id, token_ids, num_prompt_tokens)

    monkeypatch.setattr(SuffixProposer, "finish", spy)
    path = str(tiny_checkpoint("llama3-tied"))
    llm = LLM(path, max_model_len=256, speculative_config=SUFFIX)
    prompt = torch.randint(2, 320, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    answer = list(out.outputs[0].token_ids)
    assert seen == [(prompt + answer, len(prompt))]
    proposer = llm.llm_engine.core.spec.proposer
    assert proposer.propose([7, 7, *answer[:20]], 4, "new") == answer[20:24]
