"""Session leases end to end: a conversation that asked to be kept finds its prefix after other
traffic filled the pool, one that did not recomputes it, and the tokens stay the same."""

from __future__ import annotations

import torch

from inferengine import LLM, SamplingParams
from tests.conftest import hf_greedy, hf_model

SETTINGS = dict(max_model_len=176, num_gpu_blocks_override=12, enable_prefix_caching=True)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _conversation(llm: LLM, retention: str | None):
    g = torch.Generator().manual_seed(9)
    first = torch.randint(2, 320, (70,), generator=g).tolist()
    fillers = [torch.randint(2, 320, (60,), generator=g).tolist() for _ in range(3)]
    kwargs = dict(prompt_cache_key="agent-7", prompt_cache_retention=retention)
    (one,) = llm.generate([{"prompt_token_ids": first}], GREEDY, use_tqdm=False, **kwargs)
    for filler in fillers:  # unleased traffic: each fits beside the leased pages
        llm.generate([{"prompt_token_ids": filler}], GREEDY, use_tqdm=False)
    second = [*first, *one.outputs[0].token_ids, *range(200, 220)]
    (two,) = llm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False, **kwargs)
    return second, list(two.outputs[0].token_ids), two.num_cached_tokens


def test_a_leased_conversation_keeps_its_prefix_through_other_traffic(tiny_checkpoint):
    path = str(tiny_checkpoint("llama3-tied"))
    llm = LLM(path, **SETTINGS)
    second, kept_tokens, kept_cached = _conversation(llm, "1h")
    stats = llm.llm_engine.core.scheduler.make_stats().kv_tiers
    plain = LLM(path, **SETTINGS)
    _, plain_tokens, plain_cached = _conversation(plain, None)
    assert kept_cached >= 64 and plain_cached == 0
    assert kept_tokens == plain_tokens == hf_greedy(hf_model(path), second, 8)
    assert stats.sessions == 1 and stats.leased_evicted_blocks == 0
