"""The checks every integer format's tests run: layers decode to the format's own reading, and
greedy tokens (and logits) equal Transformers' float32 run of the dequantized weights; the
same through the whole engine split over two ranks."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
from safetensors.torch import load_file

from inferengine import LLM, SamplingParams
from inferengine.kernels.int4_gemm import dequantize_ref
from inferengine.model.quantization.int_weights import IntLinearMethod
from tests.conftest import hf_greedy, hf_model
from tests.model.paged_runner import PagedLoop, load_tiny
from tests.model.quantization.int_checkpoints import Scheme, reference_dequantize

FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in (5, 19, 40)]


def greedy(model, config, batch: list[list[int]], steps: int) -> list[list[int]]:
    loop = PagedLoop(model, config, num_seqs=len(batch))
    out: list[list[int]] = [[] for _ in batch]
    logits = loop.step(batch)
    for _ in range(steps):
        nxt = [[int(lg[-1].argmax())] for lg in logits]
        for tokens, token in zip(out, nxt, strict=True):
            tokens.extend(token)
        logits = loop.step(nxt)
    return out


def check_layers_decode(model, q_dir: Path, scheme: Scheme, layer: int = 1) -> None:
    """Every quantized layer of decoder layer `layer` equals the format's reading, bit for bit."""
    tensors = load_file(q_dir / "model.safetensors")
    block = model.model.layers[layer]
    for ours, parts in FUSED.items():
        module = block.get_submodule(ours)
        assert isinstance(module.quant_method, IntLinearMethod)
        want = []
        for part in parts:
            prefix = f"model.layers.{layer}.{part}."
            mine = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            want.append(reference_dequantize(scheme, mine))
        got = dequantize_ref(module.quant_method.weights(module)).t()
        torch.testing.assert_close(got, torch.cat(want), rtol=0, atol=0)


def check_against_transformers(q_dir: Path, float_dir: Path, scheme: Scheme | None) -> None:
    """Our engine on the quantized checkpoint vs Transformers (float32) on its dequantized
    weights: the same greedy tokens, logits within 1e-4."""
    model, config = load_tiny(q_dir)
    if scheme is not None:
        check_layers_decode(model, q_dir, scheme)
    batch = prompts()
    reference = hf_model(float_dir)
    expected = [hf_greedy(reference, p, 12) for p in batch]
    assert greedy(model, config, batch, 12) == expected
    with torch.no_grad():
        want_logits = reference(torch.tensor([batch[1]])).logits[0]
    got_logits = PagedLoop(model, config, 1).step([batch[1]])[0]
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=0)


def engine_greedy(path: Path, **engine_args) -> list[list[int]]:
    """Greedy tokens from `LLM` (scheduler, runner, sampler) for `prompts()`."""
    llm = LLM(str(path), device="cpu", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_two_ranks(q_dir: Path, float_dir: Path) -> None:
    """Split over two tensor-parallel ranks (gloo), the engine's greedy tokens equal
    Transformers' on the dequantized weights."""
    reference = hf_model(float_dir)
    expected = [hf_greedy(reference, p, 10) for p in prompts()]
    assert engine_greedy(q_dir, tensor_parallel_size=2) == expected
