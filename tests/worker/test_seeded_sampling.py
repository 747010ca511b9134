"""A request's seed fixes its text whatever happens around it: batch mates, preemption."""

from __future__ import annotations

import torch

from inferengine import LLM, SamplingParams


def test_seeded_outputs_survive_preemption(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen2"))
    g = torch.Generator().manual_seed(3)
    prompts = [
        {"prompt_token_ids": torch.randint(2, 320, (n,), generator=g).tolist()}
        for n in (150, 120, 90, 60)
    ]
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, max_tokens=40, ignore_eos=True)
        for i in range(4)
    ]
    roomy = LLM(path, max_model_len=256, async_scheduling=False)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    tight = LLM(path, max_model_len=256, num_gpu_blocks_override=24, max_num_batched_tokens=64)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
    assert got == expected
    alone = roomy.generate(prompts[2], params[2], use_tqdm=False)[0].outputs[0].token_ids
    assert alone == expected[2]
