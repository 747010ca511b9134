"""`LLM(..., quantization="fp8")` end to end (scheduler, model runner, sampler): its greedy
tokens and teacher-forced next-token distributions agree with the unquantized run's. On the CPU
the FP8 weights are dequantized per matmul; on a GPU the FP8 kernels run under CUDA graphs."""

from __future__ import annotations

import gc

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.model.quantization.compare import (
    LogitAgreement,
    compare_logits,
    dense_logprobs,
    token_agreement,
)
from tests.conftest import VOCAB_SIZE
from tests.model.fp8_checkpoints import write_fp8_pair


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, VOCAB_SIZE, (n,), generator=g).tolist() for n in (5, 23, 40, 64)]


def run(path, **engine_args) -> tuple[list[list[int]], torch.Tensor]:
    """(greedy tokens per prompt, every prompt position's log-probabilities over the whole
    vocabulary, stacked)."""
    llm = LLM(str(path), **engine_args)
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=VOCAB_SIZE
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    del llm
    gc.collect()
    tokens = [o.outputs[0].token_ids for o in outputs]
    positions = [lp for o in outputs for lp in (o.prompt_logprobs or [])[1:]]
    return tokens, dense_logprobs(positions, VOCAB_SIZE)


def agreement(path, **engine_args) -> tuple[float, LogitAgreement]:
    ref_tokens, ref_logprobs = run(path, **engine_args)
    fp8_tokens, fp8_logprobs = run(path, quantization="fp8", **engine_args)
    return token_agreement(ref_tokens, fp8_tokens), compare_logits(ref_logprobs, fp8_logprobs)


@pytest.mark.parametrize("arch", ["llama3-tied", "qwen2"])
def test_fp8_engine_agrees_with_unquantized_cpu(tiny_checkpoint, arch):
    tokens, stats = agreement(tiny_checkpoint(arch), device="cpu")
    print(f"{arch}: greedy tokens agree {tokens:.3f}; {stats}")
    assert stats.positions == sum(len(p) - 1 for p in _prompts())
    assert stats.argmax_agreement >= 0.9 and stats.mean_kl < 0.01, stats
    assert tokens >= 0.6


@pytest.mark.parametrize("scheme", ["ct-channel", "hf-block"])
def test_fp8_checkpoint_split_over_two_ranks(tiny_checkpoint, tmp_path, scheme):
    """Tensor parallelism (gloo, 2 ranks): each rank takes its rows (q/k/v, gate/up) or
    columns (o, down) of the FP8 weights and their scales. Per-channel scales carry over
    exactly, so the greedy tokens equal one rank's; block scales are re-quantized over each
    rank's columns, so only nearly."""
    fp8_dir, _ = write_fp8_pair(tiny_checkpoint("qwen2"), tmp_path, scheme)
    one_tokens, one = run(fp8_dir, device="cpu")
    two_tokens, two = run(fp8_dir, device="cpu", tensor_parallel_size=2)
    stats = compare_logits(one, two)
    if scheme == "ct-channel":
        assert two_tokens == one_tokens
        assert stats.argmax_agreement == 1.0 and stats.max_kl < 1e-6, stats
    else:
        assert stats.argmax_agreement >= 0.9 and stats.mean_kl < 0.01, stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama3-tied", "qwen2"])
def test_fp8_engine_agrees_with_bf16_gpu(tiny_checkpoint, arch):
    """bf16 on the GPU, CUDA graphs on (decode takes the W8A16 kernel, prefill `_scaled_mm`
    where the tiny shapes allow it)."""
    tokens, stats = agreement(
        tiny_checkpoint(arch), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3
    )
    print(f"{arch}: greedy tokens agree {tokens:.3f}; {stats}")
    assert stats.argmax_agreement >= 0.85 and stats.mean_kl < 0.02, stats
    assert tokens >= 0.5
