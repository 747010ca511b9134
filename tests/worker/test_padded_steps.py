"""Steps padded to CUDA-graph shapes (run eagerly here) give the same tokens as unpadded ones."""

from __future__ import annotations

import torch

from inferengine import LLM, SamplingParams
from tests.conftest import hf_greedy, hf_model


def test_padded_shapes_match_transformers(tiny_checkpoint):
    path = tiny_checkpoint("llama3-tied")
    llm = LLM(str(path), max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256)
    runner = llm.llm_engine.core.executor.worker.runner
    runner.capture_cuda_graphs([1, 2, 4, 8, 16], [64, 128, 256], capture=False)
    kinds = []
    replay = runner.graphs.replay

    def counting_replay(shape):
        kinds.append(shape.kind)
        return replay(shape)

    runner.graphs.replay = counting_replay
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (3, 40, 70, 1, 150, 9)]
    lengths = [12, 5, 20, 8, 3, 15]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert "decode" in kinds and "mixed" in kinds
    model = hf_model(path)
    for prompt, n, output in zip(prompts, lengths, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(model, prompt, n)
