"""Multi-LoRA offline: greedy tokens equal PEFT on Transformers (float32) for three adapters mixed
with base requests in one batch, through chunked prefill, preemption and adapter swaps."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.lora.request import LoRARequest
from tests.conftest import hf_greedy, hf_model
from tests.lora.adapters import make_adapter, peft_model

MAX_TOKENS = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """qwen3 and three adapters: rank 4 on q/v, rank 8 on every projection with rsLoRA,
    rank 16 on o/gate/down."""
    base = tiny_checkpoint("qwen3")
    root = tmp_path_factory.mktemp("adapters")
    made = [
        make_adapter(base, root / "r4", 4, ["q_proj", "v_proj"], 8, seed=1),
        make_adapter(base, root / "r8", 8, ALL, 16, rslora=True, seed=2, std=0.2),
        make_adapter(base, root / "r16", 16, ["o_proj", "gate_proj", "down_proj"], 32, seed=3),
    ]
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(made)]
    return base, loras


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 70, (n,), generator=g).tolist()
    return [torch.randint(3, 300, (m,), generator=g).tolist() for m in lengths]


def _expected(base, loras, prompts, assignment) -> list[list[int]]:
    models = {None: hf_model(base)} | {
        lora.lora_int_id: peft_model(base, lora.lora_path) for lora in loras
    }
    return [
        hf_greedy(models[None if lora is None else lora.lora_int_id], prompt, MAX_TOKENS)
        for prompt, lora in zip(prompts, assignment, strict=True)
    ]


def test_mixed_adapters_match_peft_through_chunked_prefill_preemption_and_swaps(adapters):
    base, (r4, r8, r16) = adapters
    assignment = [None, r4, r8, r16, r4, None, r16, r8, r8, None]
    prompts = _prompts(len(assignment))
    # Two device slots for three adapters (the scheduler caps a step at two, the worker swaps
    # LRU), 32-token steps (every prompt is chunked) and 14 pages (requests are preempted).
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
              max_model_len=128, max_num_batched_tokens=32, num_gpu_blocks_override=14)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
        lora_request=assignment,
    )  # fmt: skip
    ours = [o.outputs[0].token_ids for o in outputs]
    expected = _expected(base, [r4, r8, r16], prompts, assignment)
    assert ours == expected
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    slots = llm.llm_engine.core.executor.worker.runner.lora
    assert slots.num_installs >= 3  # three adapters through two slots
    # Each adapter changes what the base says (else the comparison above proves little).
    base_model = hf_model(base)
    for lora in (r4, r8, r16):
        first = assignment.index(lora)
        assert ours[first] != hf_greedy(base_model, prompts[first], MAX_TOKENS), lora.lora_name


def test_prefix_cache_keys_blocks_by_adapter(adapters):
    base, (r4, r8, _) = adapters
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128)
    prompt = {"prompt_token_ids": _prompts(1, seed=7)[0] + list(range(3, 40))}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(lora):
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens, out.outputs[0].token_ids

    cached_base, base_tokens = run(None)
    cached_r4, r4_tokens = run(r4)
    cached_r8, _ = run(r8)
    assert cached_base == 0 and cached_r4 == 0 and cached_r8 == 0  # no KV shared across adapters
    again_r4, r4_again = run(r4)
    again_base, base_again = run(None)
    assert again_r4 > 0 and again_base > 0  # each adapter hits its own pages
    assert (r4_again, base_again) == (r4_tokens, base_tokens)
    assert r4_tokens != base_tokens
