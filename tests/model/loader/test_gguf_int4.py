"""GGUF 4-bit weights kept 4-bit on the CPU: block decoding, the int4 linear against the float
reference, and a tiny GGUF model loaded int4 against the same model dequantized."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from inferengine.model.layers import quantized_cpu
from inferengine.model.layers.quantized_cpu import (
    Int4CpuLinearMethod,
    Int4LMHead,
    Int4Weight,
    int4_kernel_available,
    int8_as_int4_pair,
    pack_int4,
    unpack_int4,
)
from inferengine.model.loader import gguf_int4
from inferengine.model.loader.gguf import convert_gguf
from inferengine.model.loader.gguf_int4 import _q8_0_pair, int4_weight
from inferengine.model.loader.gguf_source import SOURCE_FILE
from tests.model.loader.tiny_gguf import _random_kquant, write_llama_gguf
from tests.model.paged_runner import PagedLoop

needs_kernel = pytest.mark.skipif(
    not int4_kernel_available(), reason="this torch has no CPU int4 kernel"
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


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K"])
def test_blocks_decode_to_gguf_values(qtype):
    rows, cols = 48, 512
    blocks = _gguf_blocks(qtype, rows, cols)
    weight = int4_weight(blocks, qtype, (rows, cols))
    assert weight.q.dtype == torch.uint8 and int(weight.q.max()) <= 15
    expected = _reference(blocks, qtype, rows, cols)
    torch.testing.assert_close(weight.dequantize(), expected, rtol=1e-6, atol=1e-6)


def test_q8_0_as_two_int4_halves_is_exact():
    import gguf

    rows, cols = 32, 256
    w = np.random.default_rng(1).normal(size=(rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    pair = _q8_0_pair(blocks, (rows, cols))
    assert pair.shape == (rows, 2 * cols)
    halves = pair.dequantize()
    torch.testing.assert_close(
        halves[:, :cols] + halves[:, cols:], _reference(blocks, "Q8_0", rows, cols), rtol=0, atol=0
    )
    q = torch.tensor([[-128, -1, 0, 1, 127] + [0] * 27], dtype=torch.int8)
    pair = int8_as_int4_pair(q, torch.tensor([[0.5]]))
    torch.testing.assert_close(pair.dequantize()[:, :32] + pair.dequantize()[:, 32:], q * 0.5)


def _random_q4_1(rows: int, cols: int, seed: int) -> Int4Weight:
    """Fresh random Q4_1 blocks: random nibbles, fp16 scales and minimums."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 20), dtype=np.uint8)
    d = rng.uniform(0.001, 0.02, size=(rows, cols // 32)).astype(np.float16)
    m = (-8 * d.astype(np.float32) + rng.normal(0, 0.01, size=d.shape)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(rows, cols // 32, 2)
    blocks[..., 2:4] = m.view(np.uint8).reshape(rows, cols // 32, 2)
    blocks = blocks.reshape(rows, -1)
    weight = int4_weight(blocks, "Q4_1", (rows, cols))
    torch.testing.assert_close(weight.dequantize(), _reference(blocks, "Q4_1", rows, cols))
    return weight


@needs_kernel
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_int4_linear_equals_the_dequantized_reference(compute):
    rows, cols = 96, 256
    weight = _random_q4_1(rows, cols, seed=2)
    reference = weight.dequantize()
    layer = nn.Linear(cols, rows, bias=True)
    method = Int4CpuLinearMethod(layer, weight, compute)
    assert "weight" not in dict(layer.named_parameters())
    bias = layer.bias.detach()
    for shape in [(0, cols), (1, cols), (5, cols), (2, 3, cols)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
        got = method.apply(layer, x, bias)
        expected = x @ reference.t() + bias
        assert got.shape == expected.shape and got.dtype == x.dtype
        if compute == torch.float32:  # exact up to float rounding
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:  # activations, scales and zeros rounded to bf16
            scale = expected.abs().max().item() if expected.numel() else 1.0
            torch.testing.assert_close(got, expected, rtol=0, atol=3e-2 * scale)


@needs_kernel
@pytest.mark.parametrize(("rows", "cols"), [(64, 32), (192, 96), (128, 576)])
def test_unpack_reverses_the_cpu_packing(rows, cols):
    g = torch.Generator().manual_seed(rows + cols)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.1
    zero = torch.randn(rows, cols // 32, generator=g) * 0.01
    packed, scales_and_zeros = pack_int4(Int4Weight(q, scale, zero), torch.bfloat16)
    # The kernel's scales and zeros are bf16: so is the reference's.
    rounded = Int4Weight(q, scale.bfloat16().float(), zero.bfloat16().float())
    torch.testing.assert_close(
        unpack_int4(packed, scales_and_zeros), rounded.dequantize(), rtol=0, atol=0
    )


@needs_kernel
def test_unpack_declines_a_tail_block():
    q = torch.zeros(48, 32, dtype=torch.uint8)
    packed, sz = pack_int4(Int4Weight(q, torch.ones(48, 1), torch.zeros(48, 1)), torch.bfloat16)
    assert unpack_int4(packed, sz) is None


@needs_kernel
@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_many_rows_run_dense_with_the_kernels_numbers(monkeypatch, q8, compute):
    """From DENSE_MIN_ROWS rows the product runs on the weight unpacked to the compute dtype:
    the int4 kernel's product up to that rounding of the weight (and the summation order)."""
    rows, cols = 128, 96
    if q8:
        g = torch.Generator().manual_seed(5)
        weight = int8_as_int4_pair(
            torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8),
            torch.rand(rows, cols // 32, generator=g) * 0.01,
        )
    else:
        weight = _random_q4_1(rows, cols, seed=3)
    layer = nn.Linear(cols, rows, bias=False)
    method = Int4CpuLinearMethod(layer, weight, compute, input_repeats=2 if q8 else 1)
    x = torch.randn(300, cols, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(quantized_cpu, "DENSE_MIN_ROWS", 10**9)
    kernel = method.apply(layer, x, None)
    monkeypatch.setattr(quantized_cpu, "DENSE_MIN_ROWS", 256)
    dense = method.apply(layer, x, None)
    assert dense.dtype == kernel.dtype == x.dtype
    # Weights and output rounded to bf16 (2^-9 relative each), not float32.
    tol = 2**-7 if compute == torch.bfloat16 else 2**-20
    torch.testing.assert_close(dense, kernel, rtol=tol, atol=tol * kernel.abs().max().item())


@needs_kernel
def test_int4_lm_head_switches_to_the_tied_weight_for_many_rows():
    vocab, hidden = 40, 64  # padded to 48 rows for the kernel
    weight = _random_q4_1(vocab, hidden, seed=3)
    dense = nn.Parameter(weight.dequantize() + 1.0, requires_grad=False)  # tell them apart
    head = Int4LMHead(vocab, weight.pad_rows(), torch.float32, tied=dense)
    few = torch.randn(Int4LMHead.INT4_MAX_ROWS, hidden)
    many = torch.randn(Int4LMHead.INT4_MAX_ROWS + 1, hidden)
    torch.testing.assert_close(head.compute_logits(few), few @ weight.dequantize().t())
    torch.testing.assert_close(head.compute_logits(many), many @ dense.t())


def _tiny_gguf(tiny_llama, tmp_path, variant: str):
    """A tiny Llama as Q4_1, with one layer's down projection Q8_0 (no int4 form: stays dense)
    and, untied, a Q4_0 output head."""
    types = {"blk.1.ffn_down.weight": "Q8_0"}
    if variant == "untied":
        types["output.weight"] = "Q4_0"
    return write_llama_gguf(
        tiny_llama(variant), tmp_path / f"tiny-{variant}.gguf", "Q4_1", tensor_types=types
    )


def _load(folder, dequantize: bool = False, device: str = "cpu"):
    from inferengine.attention.backends.torch_ref import TorchAttentionBackend
    from inferengine.config import ModelConfig
    from inferengine.model.loader.loader import load_model
    from inferengine.model.loader.resolve import resolve_model

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


def _int4_modules(model: nn.Module) -> list[str]:
    return [
        name
        for name, m in model.named_modules()
        if isinstance(getattr(m, "quant_method", None), Int4CpuLinearMethod)
        or isinstance(m, Int4LMHead)
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


@needs_kernel
@pytest.mark.parametrize("variant", ["untied", "tied-llama3"])
def test_tiny_gguf_int4_model_equals_dequantized(tiny_llama, tmp_path, monkeypatch, variant):
    """Computing in float32 inside the kernel (a test-only switch), the int4 model's logits are
    the dequantized float32 model's: the rows, their q/k order, the fused shards and the head
    are all in place."""
    monkeypatch.setattr(gguf_int4, "int4_kernel_is_fast", lambda: True)
    monkeypatch.setattr(gguf_int4, "compute_dtype_for", lambda dtype: torch.float32)
    folder = convert_gguf(_tiny_gguf(tiny_llama, tmp_path, variant), tmp_path / "converted")
    assert (folder / SOURCE_FILE).is_file()
    int4_model, config = _load(folder)
    names = _int4_modules(int4_model)
    assert "model.layers.1.mlp.down_proj" not in names  # Q8_0: dense
    assert "model.layers.0.mlp.down_proj" in names and "lm_head" in names
    assert "model.layers.1.self_attn.qkv_proj" in names and len(names) == 2 * 4 - 1 + 1

    dense_model, _ = _load(folder, dequantize=True)
    assert _int4_modules(dense_model) == []
    assert_same_logits(int4_model, dense_model, config, tol=1e-4)


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_int4_greedy_tokens_match_the_dequantized_engine(
    tiny_llama, tmp_path, monkeypatch, dtype
):
    """The engine as users run it (activations enter the kernel in bf16): greedy tokens equal
    the dequantized engine's, or part where the dequantized run's top two were near-tied."""
    from inferengine import LLM

    monkeypatch.setattr(gguf_int4, "int4_kernel_is_fast", lambda: True)
    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    path = str(_tiny_gguf(tiny_llama, tmp_path, "untied"))
    runs = {}
    for dequantize in (False, True):
        llm = LLM(path, dtype=dtype, max_model_len=128, gguf_dequantize=dequantize)
        runs[dequantize] = greedy_with_logprobs(llm, max_tokens=10)
        del llm
    assert_equal_up_to_near_ties(runs[False], runs[True], margin=0.05)


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


def test_int4_only_on_the_cpu(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_int4, "int4_kernel_is_fast", lambda: True)
    folder = convert_gguf(_tiny_gguf(tiny_llama, tmp_path, "untied"), tmp_path / "converted")
    model, config = _load(folder, dequantize=True)
    config.gguf_dequantize = False
    taken = gguf_int4.install_int4_linears(model, config, torch.device("meta"), torch.float32)
    assert taken == frozenset() and _int4_modules(model) == []


def test_slow_kernel_keeps_float_weights(tiny_llama, tmp_path, monkeypatch):
    """Where torch's int4 kernel has no AVX-512 code, dense weights are faster: kept."""
    monkeypatch.setattr(quantized_cpu.torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    folder = convert_gguf(_tiny_gguf(tiny_llama, tmp_path, "untied"), tmp_path / "converted")
    model, _ = _load(folder)
    assert _int4_modules(model) == []


def test_engine_auto_dtype_is_bf16_for_gguf_on_a_native_bf16_cpu(tiny_llama, tmp_path, monkeypatch):
    from inferengine.engine.arg_utils import EngineArgs
    from inferengine.worker import cpu_env

    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = str(_tiny_gguf(tiny_llama, tmp_path, "untied"))
    hf_folder = str(tiny_llama("untied"))

    def dtype(model: str, native: bool, **kw) -> str:
        monkeypatch.setattr(cpu_env, "native_bf16", lambda: native)
        args = EngineArgs(model=model, device="cpu", max_model_len=64, **kw)
        return args.create_engine_config().model_config.dtype

    assert dtype(gguf_path, native=True) == "bfloat16"
    assert dtype(gguf_path, native=False) == "float32"
    assert dtype(gguf_path, native=True, dtype="float32") == "float32"  # the user's wins
    assert dtype(hf_folder, native=True) == "float32"  # Transformers' reference precision
    config = EngineArgs(model=gguf_path, gguf_dequantize=True).create_engine_config()
    assert config.model_config.gguf_dequantize


def test_a_conversion_without_the_gguf_is_converted_again(tiny_llama, tmp_path, monkeypatch):
    from inferengine.model.loader.gguf_source import SOURCE_INDEX, has_source
    from inferengine.model.loader.resolve import resolve_model

    monkeypatch.setenv("INFERENGINE_CACHE_DIR", str(tmp_path / "cache"))
    gguf_path = _tiny_gguf(tiny_llama, tmp_path, "untied")
    folder = resolve_model(str(gguf_path)).path
    assert has_source(folder) and (folder / SOURCE_FILE).stat().st_nlink == 2  # a hard link
    (folder / SOURCE_INDEX).unlink()  # as a folder converted before the GGUF was kept
    assert resolve_model(str(gguf_path)).path == folder and has_source(folder)
