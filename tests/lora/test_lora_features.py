"""Adapters with the engine's other features on the CPU: n-gram speculation (greedy tokens still
equal PEFT's), grammars, session leases and prefix hits; a draft model is refused."""

from __future__ import annotations

import re

import pytest

from inferengine import LLM, SamplingParams
from inferengine.errors import ConfigError
from inferengine.lora.request import LoRARequest
from inferengine.sampling_params import StructuredOutputsParams
from tests.conftest import hf_greedy
from tests.lora.adapters import make_adapter, peft_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("qwen3")
    path = make_adapter(base, tmp_path_factory.mktemp("feat") / "r8", 8, ALL, 16, seed=4, std=0.2)
    return base, LoRARequest("r8", 1, str(path))


def test_ngram_speculation_with_adapters_keeps_peft_tokens(adapter):
    base, lora = adapter
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}  # fmt: skip
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, max_model_len=128,
              speculative_config=spec)  # fmt: skip
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=[lora, None])  # fmt: skip
    peft = peft_model(base, lora.lora_path)
    assert outs[0].outputs[0].token_ids == hf_greedy(peft, prompts[0], 16)
    stats = llm.llm_engine.core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0


def test_grammars_and_sessions_with_adapters(adapter):
    base, lora = adapter
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, max_model_len=128)
    regex = StructuredOutputsParams(regex=r"[ab]{3}-[0-9]{2}")
    out = llm.generate("Say:", SamplingParams(temperature=0, max_tokens=12, structured_outputs=regex),
                       use_tqdm=False, lora_request=lora)[0]  # fmt: skip
    assert re.fullmatch(r"[ab]{3}-[0-9]{2}", out.outputs[0].text)
    prompt = {"prompt_token_ids": list(range(3, 60))}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False, lora_request=lora,
                         prompt_cache_key="s1", prompt_cache_retention="in_memory")[0]  # fmt: skip
    again = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
    assert (
        again.num_cached_tokens >= 48 and again.outputs[0].token_ids == first.outputs[0].token_ids
    )


def test_a_draft_model_is_refused_with_adapters(adapter):
    base, _ = adapter
    spec = {"method": "draft_model", "model": str(base), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="draft_model"):
        LLM(str(base), enable_lora=True, max_model_len=128, speculative_config=spec)
