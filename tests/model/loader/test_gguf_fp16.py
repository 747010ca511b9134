"""fbgemm's float16 GEMM under float32 linear layers on the CPU: the method against a float32
matmul over the same weights rounded to float16, and what `pack_linears_fp16` replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inferengine.model.layers.fp16_cpu import (
    Fp16PackedLinearMethod,
    Fp16PackedLMHead,
    fp16_gemm_available,
    pack_linears_fp16,
)
from inferengine.model.layers.linear import ColumnParallelLinear, RowParallelLinear

pytestmark = pytest.mark.skipif(not fp16_gemm_available(), reason="this torch has no fbgemm")


@pytest.mark.parametrize("shape", [(1, 96), (5, 96), (2, 3, 96), (130, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_method_equals_a_float32_matmul_over_float16_weights(shape, with_bias):
    torch.manual_seed(len(shape) * 100 + shape[0])
    layer = RowParallelLinear(96, 40, bias=with_bias)
    layer.weight.data.normal_()
    if with_bias:
        layer.bias.data.normal_()
    weight = layer.weight.detach().clone()
    x = torch.randn(shape)
    want = F.linear(x, weight.half().float(), layer.bias)
    layer.quant_method = Fp16PackedLinearMethod(layer)
    assert "weight" not in dict(layer.named_parameters())  # the float32 copy is freed
    got = layer(x)
    assert got.shape == (*shape[:-1], 40) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Against the unrounded weights: float16 moves each by at most 2^-11 of itself, so the
    # outputs (about 10 in size here) move by thousandths.
    torch.testing.assert_close(got, F.linear(x, weight, layer.bias), rtol=0, atol=2e-2)


def test_bfloat16_inputs_come_back_bfloat16():
    layer = ColumnParallelLinear(64, [32], bias=False)
    layer.weight.data.normal_()
    layer.quant_method = Fp16PackedLinearMethod(layer)
    assert layer(torch.randn(3, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_pack_linears_replaces_every_float32_linear_and_the_head(tiny_llama):
    """A tied head keeps the embedding's float32 weight (lookups read it); logits stay close."""
    from tests.model.paged_runner import PagedLoop, load_tiny

    model, config = load_tiny(tiny_llama("tied-llama3"))
    prompts = [[1, 5, 9, 33, 70], [2, 100, 200]]
    before = PagedLoop(model, config, len(prompts)).step(prompts)
    linears = [
        m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
    ]
    embedding = model.model.embed_tokens.weight
    assert pack_linears_fp16(model) == len(linears) + 1
    assert all(isinstance(m.quant_method, Fp16PackedLinearMethod) for m in linears)
    assert isinstance(model.lm_head, Fp16PackedLMHead) and model.lm_head.weight is embedding
    assert pack_linears_fp16(model) == 0  # nothing left to pack
    after = PagedLoop(model, config, len(prompts)).step(prompts)
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def _fp16_modules(model) -> list[str]:
    return [
        name
        for name, m in model.named_modules()
        if isinstance(getattr(m, "quant_method", None), Fp16PackedLinearMethod)
        or isinstance(m, Fp16PackedLMHead)
    ]


def test_gguf_without_our_kernels_loads_float16_packed(tiny_llama, tmp_path, monkeypatch):
    """Where our CPU kernels cannot be built: every linear layer and the head take fbgemm's
    float16 GEMM, and the logits stay within float16 rounding of the float32 model's;
    --gguf-dequantize keeps float32."""
    from inferengine.checkpoint.gguf import convert_gguf
    from inferengine.model.loader import gguf_quantized
    from tests.model.loader.test_gguf_quantized import _load, _tiny_gguf, assert_same_logits

    monkeypatch.setattr(gguf_quantized.cpu_native, "native_ops", lambda: None)
    folder = convert_gguf(_tiny_gguf(tiny_llama, tmp_path, "untied"), tmp_path / "converted")
    packed, config = _load(folder)
    names = _fp16_modules(packed)
    assert "lm_head" in names and "model.layers.1.mlp.down_proj" in names
    assert len(names) == 4 * 2 + 1  # qkv, o, gate_up, down in each of 2 layers, the head
    dense, _ = _load(folder, dequantize=True)
    assert _fp16_modules(dense) == []
    assert_same_logits(packed, dense, config, tol=1e-2)

    monkeypatch.setattr(gguf_quantized, "fp16_gemm_available", lambda: False)
    assert _fp16_modules(_load(folder)[0]) == []  # no fbgemm: float32 as before


def test_engine_greedy_tokens_match_the_float32_engine(tiny_llama, tmp_path, monkeypatch):
    """As users run it without our kernels: greedy tokens equal the --gguf-dequantize engine's,
    or part where that run's top two were near-tied."""
    from inferengine import LLM
    from inferengine.model.loader import gguf_quantized
    from tests.model.loader.test_gguf_quantized import (
        _tiny_gguf,
        assert_equal_up_to_near_ties,
        greedy_with_logprobs,
    )

    monkeypatch.setattr(gguf_quantized.cpu_native, "native_ops", lambda: None)
    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(_tiny_gguf(tiny_llama, tmp_path, "tied-llama3"))
    runs = {}
    for dequantize in (False, True):
        llm = LLM(path, dtype="float32", max_model_len=128, gguf_dequantize=dequantize)
        model = llm.llm_engine.core.executor.worker.runner.model
        assert bool(_fp16_modules(model)) is not dequantize
        runs[dequantize] = greedy_with_logprobs(llm, max_tokens=12)
        del llm
    assert_equal_up_to_near_ties(runs[False], runs[True], margin=0.01)
