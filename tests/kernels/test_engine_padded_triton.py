"""The engine with the Triton attention backend (under the interpreter here) on steps padded to
CUDA-graph shapes, with more requests than `max_num_seqs`: full batches padded with tokens only,
as a GPU serving queued requests runs them. Tokens equal Transformers'."""

from __future__ import annotations

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.attention import selector
from tests.conftest import hf_greedy, hf_model


@pytest.fixture
def triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the engine pick the Triton backend on the CPU (kernels/conftest interprets it)."""
    monkeypatch.setattr(selector, "_triton_usable", lambda device: True)


def test_full_padded_batches_match_transformers(tiny_checkpoint, triton_on_cpu):
    path = tiny_checkpoint("llama3-tied")
    llm = LLM(
        str(path),
        attention_backend="triton",
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    runner = llm.llm_engine.core.executor.worker.runner
    runner.capture_cuda_graphs([1, 2, 4], [64], capture=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (9, 30, 5, 17, 40, 12)]
    lengths = [6, 3, 9, 4, 5, 7]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = hf_model(path)
    for prompt, n, output in zip(prompts, lengths, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, n)
