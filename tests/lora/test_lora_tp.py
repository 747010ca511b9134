"""Adapters under tensor parallelism (two CPU ranks, gloo): A and B are split as the base layer
is (column-parallel: B's output rows, KV heads replicated where ranks outnumber them;
row-parallel: A's input columns, summed by the layer's all-reduce); tokens equal PEFT's."""

from __future__ import annotations

import pytest

from inferengine import LLM, SamplingParams
from inferengine.lora.request import LoRARequest
from tests.conftest import hf_greedy, hf_model
from tests.lora.adapters import make_adapter, peft_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# qwen3: one KV head, replicated on both ranks; llama3-tied: two KV heads, one per rank
@pytest.mark.parametrize("arch", ["qwen3", "llama3-tied"])
def test_two_ranks_split_adapters_as_their_layers(tiny_checkpoint, tmp_path, arch):
    base = tiny_checkpoint(arch)
    r8 = make_adapter(base, tmp_path / "r8", 8, ALL, 16, rslora=True, seed=5, std=0.2)
    r4 = make_adapter(base, tmp_path / "r4", 4, ["k_proj", "o_proj", "up_proj"], 8, seed=6)
    loras = [LoRARequest("r8", 1, str(r8)), None, LoRARequest("r4", 2, str(r4))]
    prompts = [list(range(5, 40)), list(range(50, 71)), list(range(9, 60, 2))]
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
              tensor_parallel_size=2)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)  # fmt: skip
    models = [peft_model(base, r8), hf_model(base), peft_model(base, r4)]
    expected = [hf_greedy(m, p, 8) for m, p in zip(models, prompts, strict=True)]
    assert [o.outputs[0].token_ids for o in outs] == expected
