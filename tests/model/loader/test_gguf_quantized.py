"""GGUF weights kept quantized on the CPU: block decoding, a tiny GGUF model loaded quantized
against the same model dequantized, the engine's greedy tokens, and where the weights stay
dense."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from inferengine.checkpoint.gguf import convert_gguf
from inferengine.checkpoint.gguf_source import SOURCE_FILE
from inferengine.kernels import cpu_native
from inferengine.model.layers.block_quant_cpu import BlockQuantLinearMethod, BlockQuantLMHead
from inferengine.model.loader import gguf_quantized
from inferengine.model.loader.gguf_quantized import block_weight
from tests.model.loader.tiny_gguf import _random_kquant, write_llama_gguf
from tests.model.paged_runner import PagedLoop

needs_kernels = pytest.mark.skipif(
    cpu_native.native_ops() is None, reason=f"no CPU kernels: {cpu_native.unavailable_reason()}"
)


def _gguf_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    import gguf

    rng = np.random.default_rng(seed)
    if qtype == "Q4_K":
        return _random_kquant(rows, cols, qtype, rng)
    w = rng.normal(0.0, 0.05, size=(rows, cols)).astype(np.float32) + rng.normal(
        0.0, 0.05, size=(rows, 1)
    ).astype(np.float32)  # offsets per row, so Q4_1's minimum matters
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def _reference(blocks: np.ndarray, qtype: str, rows: int, cols: int) -> torch.Tensor:
    import gguf

    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(rows, cols))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0"])
def test_blocks_decode_to_gguf_values(qtype):
    rows, cols = 48, 512
    blocks = _gguf_blocks(qtype, rows, cols)
    weight = block_weight(blocks, qtype, (rows, cols))
    if weight.kind == "q4":
        assert weight.values.dtype == torch.uint8 and int(weight.values.max()) <= 15
    else:
        assert weight.values.dtype == torch.int8 and int(weight.values.abs().max()) <= 127
    expected = _reference(blocks, qtype, rows, cols)
    torch.testing.assert_close(weight.dequantize(), expected, rtol=0, atol=0)


def _tiny_gguf(tiny_llama, tmp_path, variant: str):
    """A tiny Llama as Q4_1, with one layer's down projection Q8_0, its output projection Q6_K
    (which our kernels do not take: dense) and, untied, a Q4_0 output head."""
    types = {"blk.1.ffn_down.weight": "Q8_0", "blk.1.attn_output.weight": "Q6_K"}
    if variant == "untied":
        types["output.weight"] = "Q4_0"
    return write_llama_gguf(
        tiny_llama(variant), tmp_path / f"tiny-{variant}.gguf", "Q4_1", tensor_types=types
    )


def _load(folder, dequantize: bool = False, device: str = "cpu"):
    from inferengine.attention.backends.torch_ref import TorchAttentionBackend
    from inferengine.checkpoint.resolve import resolve_model
    from inferengine.config import ModelConfig
    from inferengine.model.loader.loader import load_model

    resolved = resolve_model(str(folder))
    config = ModelConfig(
        model=str(folder),
        model_path=str(resolved.path),
        hf_config=resolved.hf_config,
        dtype="float32",
        max_model_len=256,
        gguf_dequantize=dequantize,
    )
    return load_model(config, torch.device(device), TorchAttentionBackend()), config


def _quantized_modules(model: nn.Module) -> list[str]:
    return [
        name
        for name, m in model.named_modules()
        if isinstance(getattr(m, "quant_method", None), BlockQuantLinearMethod)
        or isinstance(m, BlockQuantLMHead)
    ]


def _logits(model, config, prompts: list[list[int]]) -> list[torch.Tensor]:
    loop = PagedLoop(model, config, len(prompts))
    first = loop.step(prompts)
    return [torch.cat([f, n]) for f, n in zip(first, loop.step([[7]] * len(prompts)), strict=True)]


def assert_same_logits(model, reference, config, tol: float) -> None:
    """Two models' logits (a prefill of two prompts, then one decode step) agree within tol."""
    prompts = [[1, 5, 9, 33, 70], [2, 100, 200]]
    pairs = zip(_logits(model, config, prompts), _logits(reference, config, prompts), strict=True)
    for got, expected in pairs:
        torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@needs_kernels
@pytest.mark.parametrize("variant", ["untied", "tied-llama3"])
def test_tiny_gguf_quantized_model_equals_dequantized(tiny_llama, tmp_path, variant):
    """The quantized model's logits are the dequantized float32 model's up to the activations'
    two-term int8 rounding: the rows, their q/k order, the fused shards and the head are all in
    place (a misplaced row would move them by whole units)."""
    folder = convert_gguf(_tiny_gguf(tiny_llama, tmp_path, variant), tmp_path / "converted")
    assert (folder / SOURCE_FILE).is_file()
    model, config = _load(folder)
    names = _quantized_modules(model)
    assert "model.layers.1.mlp.down_proj" in names  # Q8_0
    assert "model.layers.1.self_attn.o_proj" not in names  # Q6_K: dense
    assert "model.layers.0.mlp.down_proj" in names and "lm_head" in names
    assert "model.layers.1.self_attn.qkv_proj" in names and len(names) == 2 * 4 - 1 + 1

    dense_model, _ = _load(folder, dequantize=True)
    assert _quantized_modules(dense_model) == []
    assert_same_logits(model, dense_model, config, tol=2e-3)


@needs_kernels
def test_engine_greedy_tokens_match_the_dequantized_engine(tiny_llama, tmp_path, monkeypatch):
    """The engine as users run it (float32, `cpu` attention): greedy tokens equal the
    dequantized engine's, or part where the dequantized run's top two were near-tied."""
    from inferengine import LLM

    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(_tiny_gguf(tiny_llama, tmp_path, "untied"))
    runs = {}
    for dequantize in (False, True):
        llm = LLM(path, max_model_len=128, gguf_dequantize=dequantize)
        model = llm.llm_engine.core.executor.worker.runner.model
        assert bool(_quantized_modules(model)) != dequantize
        runs[dequantize] = greedy_with_logprobs(llm, max_tokens=10)
        del llm
    assert_equal_up_to_near_ties(runs[False], runs[True], margin=0.01)


def greedy_with_logprobs(llm, max_tokens: int) -> list:
    """Three prompts' greedy completions (EOS ignored) with their top-two logprobs."""
    from inferengine import SamplingParams

    prompts = [[1, 5, 9, 33, 70], [2, 100, 200, 17], [3] * 20]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def assert_equal_up_to_near_ties(runs: list, reference: list, margin: float) -> None:
    """Each completion equals the reference's, or parts where the reference's top two logprobs
    were within `margin`."""
    for got, want in zip(runs, reference, strict=True):
        if list(got.token_ids) == list(want.token_ids):
            continue
        at = next(
            i for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids, strict=True)) if a != b
        )
        top = sorted((lp.logprob for lp in want.logprobs[at].values()), reverse=True)
        assert top[0] - top[1] < margin, f"parted at {at} with a margin of {top[0] - top[1]}"


def test_quantized_only_on_the_cpu(tiny_llama, tmp_path):
    folder = convert_gguf(_tiny_gguf(tiny_llama, tmp_path, "untied"), tmp_path / "converted")
    _, config = _load(folder, dequantize=True)
    config.gguf_dequantize = False
    meta = gguf_quantized.gguf_quant_config(config, torch.device("meta"), torch.float32)
    assert meta is None


@needs_kernels
def test_quantized_layers_are_built_over_their_blocks(tiny_llama, tmp_path):
    """Quantization at construction: a layer the GGUF's blocks serve is built over them and never
    has a float weight; the others are built as float layers and load the folder's floats."""
    folder = convert_gguf(_tiny_gguf(tiny_llama, tmp_path, "untied"), tmp_path / "converted")
    model, _ = _load(folder)
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        assert module.prefix == name
        blocks = isinstance(method, BlockQuantLinearMethod)
        assert ("weight" in module._parameters) != blocks, name
        assert ("weight_packed" in module._buffers) == blocks, name


def test_engine_auto_dtype_is_float32_on_the_cpu(tiny_llama, tmp_path, monkeypatch):
    from inferengine.engine.arg_utils import EngineArgs

    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = str(_tiny_gguf(tiny_llama, tmp_path, "untied"))

    def dtype(model: str, **kw) -> str:
        args = EngineArgs(model=model, device="cpu", max_model_len=64, **kw)
        return args.create_engine_config().model_config.dtype

    assert dtype(gguf_path) == "float32"
    assert dtype(str(tiny_llama("untied"))) == "float32"
    assert dtype(gguf_path, dtype="bfloat16") == "bfloat16"  # the user's wins
    config = EngineArgs(model=gguf_path, gguf_dequantize=True).create_engine_config()
    assert config.model_config.gguf_dequantize


def test_a_conversion_without_the_gguf_is_converted_again(tiny_llama, tmp_path, monkeypatch):
    from inferengine.checkpoint.gguf_source import SOURCE_INDEX, has_source
    from inferengine.checkpoint.resolve import resolve_model

    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = _tiny_gguf(tiny_llama, tmp_path, "untied")
    folder = resolve_model(str(gguf_path)).path
    assert has_source(folder) and (folder / SOURCE_FILE).stat().st_nlink == 2  # a hard link
    (folder / SOURCE_INDEX).unlink()  # as a folder converted before the GGUF was kept
    assert resolve_model(str(gguf_path)).path == folder and has_source(folder)


@needs_kernels
@pytest.mark.parametrize("variant", ["untied", "tied-llama3"])
def test_the_embedding_stays_in_blocks_and_looks_up_the_dequantized_rows(
    tiny_llama, tmp_path, variant
):
    from inferengine.model.layers.block_quant_cpu import BlockQuantEmbedding

    folder = convert_gguf(_tiny_gguf(tiny_llama, tmp_path, variant), tmp_path / "converted")
    model, _ = _load(folder)
    table = _load(folder, dequantize=True)[0].model.embed_tokens.weight
    embedding = model.model.embed_tokens
    assert isinstance(embedding, BlockQuantEmbedding)
    rows = embedding(torch.arange(table.shape[0]))
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, table, rtol=0, atol=0)
    ids = torch.tensor([[3, 1, 4], [1, 5, 9]])
    torch.testing.assert_close(embedding(ids), table[ids], rtol=0, atol=0)
    # No float copy of the table is left, tied head or not.
    assert model.lm_head.weight is None
    assert all(p.numel() < table.numel() for p in model.parameters())
