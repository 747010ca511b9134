"""Adapters over a quantized base: the LoRA wrapper calls the layer's own weight method (here
AWQ int4 on the CPU), so tokens equal PEFT on Transformers over the dequantized weights."""

from __future__ import annotations

from inferengine import LLM, SamplingParams
from inferengine.lora.request import LoRARequest
from tests.conftest import build_checkpoint, hf_greedy, hf_model
from tests.lora.adapters import make_adapter, peft_model
from tests.model.quantization.int_checkpoints import Scheme, write_int_pair

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_adapters_over_an_awq_base_equal_peft_on_its_dequantized_weights(tmp_path):
    source = build_checkpoint("qwen2", tmp_path / "src", hidden_size=128, intermediate_size=256)
    q_dir, float_dir = write_int_pair(source, tmp_path, Scheme("awq", 4, 32), "awq")
    adapter = make_adapter(float_dir, tmp_path / "r8", 8, ALL, 16, seed=7, std=0.2)
    llm = LLM(str(q_dir), enable_lora=True, max_lora_rank=8, max_model_len=128, device="cpu")
    prompts = [list(range(5, 40)), list(range(60, 90))]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[LoRARequest("r8", 1, str(adapter)), None])  # fmt: skip
    expected = [hf_greedy(peft_model(float_dir, adapter), prompts[0], 10),
                hf_greedy(hf_model(float_dir), prompts[1], 10)]  # fmt: skip
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert expected[0] != hf_greedy(hf_model(float_dir), prompts[0], 10)
