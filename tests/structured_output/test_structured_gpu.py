"""Structured output on CUDA (`pytest -m gpu`): the packed mask is unpacked and applied on the
device before sampling, with CUDA graphs and async scheduling on, so every finished JSON output
validates; under n-gram speculation every draft row is masked, so greedy tokens equal those
without speculation; requests without a grammar beside them keep their tokens."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from test_structured_engine import SCHEMA

from inferengine import LLM, SamplingParams
from inferengine.sampling_params import StructuredOutputsParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, max_model_len=512, device="cuda", gpu_memory_utilization=0.3, **kwargs)


def test_every_finished_json_output_validates_on_cuda(tiny_checkpoint):
    llm = _llm(str(tiny_checkpoint("qwen3")))
    assert llm.llm_engine.core.executor.worker.runner.graphs is not None
    params = SamplingParams(
        temperature=1.0, max_tokens=160, n=100, seed=7,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )  # fmt: skip
    (out,) = llm.generate(["hello"], params, use_tqdm=False)
    finished = [c.text for c in out.outputs if c.finish_reason == "stop"]
    assert len(finished) >= 90
    for text in finished:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_plain_neighbours_keep_their_tokens_on_cuda(tiny_checkpoint):
    llm = _llm(str(tiny_checkpoint("qwen3")), dtype="float32")
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], plain, use_tqdm=False)
    constrained = SamplingParams(
        temperature=1.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    mixed = llm.generate(
        [{"prompt_token_ids": [9, 10]}] * 3 + [{"prompt_token_ids": [5, 6, 7, 8]}],
        [constrained] * 3 + [plain],
        use_tqdm=False,
    )
    assert mixed[-1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_speculation_under_a_grammar_matches_plain_decoding_on_cuda(tiny_checkpoint):
    path = str(tiny_checkpoint("qwen3"))
    structured = StructuredOutputsParams(regex=r"(abc-){6}[0-9]{4}")
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=structured)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 9, 2, 4]}]
    plain = _llm(path, dtype="float32").generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    speculating = _llm(path, dtype="float32", speculative_config=spec)
    drafted = speculating.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert speculating.llm_engine.core.scheduler.spec_stats.num_accepted_tokens > 0
