"""The CPU backend against the torch reference on random paged steps: the same pages stored,
the same attention (its decode path attends in float32, so bf16 agrees to rounding), with and
without padding rows, sliding windows, soft-capping, GQA and an fp8 cache; `auto` picks it on
the CPU."""

import zlib

import pytest
import torch

from inferengine.attention import selector
from inferengine.attention.autotune import AttentionShape
from inferengine.attention.backends.base import AttentionSpec
from inferengine.attention.backends.cpu import CpuAttentionBackend
from inferengine.attention.backends.torch_ref import TorchAttentionBackend
from inferengine.kernels.kv_quant import as_bytes, quantize
from tests.attention.test_flex_backend import CASES, paged_step


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _run(backend, spec, q, k, v, cache, md):
    cache = cache.clone()
    out = backend.forward(spec, q, k, v, cache, md)
    return out, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding", [0, 3])
@pytest.mark.parametrize(("sliding_window", "cap"), [(None, None), (6, None), (None, 3.0)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("case", CASES)
def test_cpu_backend_matches_the_reference(gen, case, heads, kv_heads, sliding_window, cap,
                                           padding, dtype):  # fmt: skip
    q_lens, seq_lens = CASES[case]
    shared = 1 if case == "mixed_with_prefix_hits" else 0
    q, k, v, cache, md = paged_step(
        gen, q_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=16, block_size=4,
        shared_pages=shared, padding=padding,
    )  # fmt: skip
    q, k, v, cache = (t.to(dtype) for t in (q, k, v, cache))
    spec = AttentionSpec(heads, kv_heads, 16, 0.25, sliding_window, cap)
    # Each forward gets fresh metadata: what a step shares is cached in `per_step`.
    expected, ref_cache = _run(TorchAttentionBackend(), spec, q, k, v, cache, md)
    md.per_step.clear()
    out, cpu_cache = _run(CpuAttentionBackend(), spec, q, k, v, cache, md)
    assert torch.equal(cpu_cache, ref_cache)
    n = md.num_actual_tokens
    if case != "decode":  # prefill and mixed steps are the reference's own path
        assert torch.equal(out[:n], expected[:n])
    else:  # decode attends in float32: compare with the reference in float32
        md.per_step.clear()
        f32 = (t.float() for t in (q, k, v, cache))
        expected, _ = _run(TorchAttentionBackend(), spec, *f32, md)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[:n].float(), expected[:n], atol=tol, rtol=tol)
    assert out.dtype == dtype and out.shape == q.shape


def test_second_layer_of_a_step_reuses_the_step_and_matches(gen):
    q_lens, seq_lens = CASES["decode"]
    q, k, v, cache, md = paged_step(
        gen, q_lens, seq_lens, heads=8, kv_heads=2, head_dim=16, block_size=4
    )
    spec = AttentionSpec(8, 2, 16, 0.25, 6)
    backend = CpuAttentionBackend()
    first = backend.forward(spec, q, k, v, cache.clone(), md)
    assert "cpu_decode" in md.per_step
    second = backend.forward(spec, q, k, v, cache.clone(), md)
    assert torch.equal(first, second)
    plain = AttentionSpec(8, 2, 16, 0.25)  # another window in the same step: its own mask
    expected = TorchAttentionBackend().forward(plain, q, k, v, cache.clone(), md)
    torch.testing.assert_close(backend.forward(plain, q, k, v, cache.clone(), md), expected)


def test_fp8_cache_stores_and_reads_like_the_reference(gen):
    q_lens, seq_lens = CASES["decode"]
    q, k, v, cache, md = paged_step(
        gen, q_lens, seq_lens, heads=8, kv_heads=2, head_dim=16, block_size=4
    )
    fp8 = quantize(cache, 0.5, torch.float8_e4m3fn)
    spec = AttentionSpec(8, 2, 16, 0.25, k_scale=0.5, v_scale=0.25)
    ref = fp8.clone()
    expected = TorchAttentionBackend().forward(spec, q, k, v, ref, md)
    md.per_step.clear()
    mine = fp8.clone()
    out = CpuAttentionBackend().forward(spec, q, k, v, mine, md)
    assert torch.equal(as_bytes(mine), as_bytes(ref))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_auto_is_the_cpu_backend_on_the_cpu_and_torch_stays_the_reference():
    shape = AttentionShape(8, 2, 64, 16, torch.bfloat16)
    assert selector.get_attention_backend("auto", "cpu", shape).name == "cpu"
    assert selector.get_attention_backend("torch", "cpu", shape).name == "torch"
    assert list(selector.usable_backends("cpu", shape))[:2] == ["cpu", "torch"]
