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


def test_verify_steps_padded_to_verify_shapes_match_plain_decoding(tiny_checkpoint):
    """Speculating steps take the verify shapes (B sequences of up to 1 + k tokens)."""
    path = str(tiny_checkpoint("qwen2"))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    g = torch.Generator().manual_seed(8)
    base = [torch.randint(2, 320, (n,), generator=g).tolist() for n in (4, 7, 11, 5)]
    prompts = [{"prompt_token_ids": b * 4} for b in base]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outputs, kinds = [], []
    for speculative_config in (None, spec):
        llm = LLM(path, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=256,
                  speculative_config=speculative_config)  # fmt: skip
        runner = llm.llm_engine.core.executor.worker.runner
        runner.capture_cuda_graphs([1, 2, 4, 8], [64, 128, 256], capture=False)
        replay = runner.graphs.replay

        def counting_replay(shape, replay=replay):
            kinds.append(shape.kind)
            return replay(shape)

        runner.graphs.replay = counting_replay
        outputs.append(
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        )
        if speculative_config is not None:
            assert runner.graphs.verify_sizes == [1, 2, 4, 8]
            assert llm.llm_engine.core.scheduler.spec_stats.num_accepted_tokens > 0
    assert "verify" in kinds
    assert outputs[0] == outputs[1]
