"""The CPU backend against the torch reference on random paged steps: the same pages stored,
the same attention (its one-query rows attend in float32, through our C++ kernel or torch ops,
and prompt chunks take SDPA's flash kernel, so it agrees to rounding), with and without padding
rows, sliding windows, soft-capping, GQA and an fp8 cache; mixed steps batch their one-query
rows; `auto` picks it on the CPU."""

import zlib

import pytest
import torch

from inferengine.attention import selector
from inferengine.attention.autotune import AttentionShape
from inferengine.attention.backends.base import AttentionSpec
from inferengine.attention.backends.cpu import CpuAttentionBackend
from inferengine.attention.backends.torch_ref import TorchAttentionBackend
from inferengine.kernels import cpu_native
from inferengine.kernels.kv_quant import as_bytes, quantize
from tests.attention.test_flex_backend import CASES, paged_step


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=["native", "torch"])
def kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decode steps through our C++ kernel, or (where it cannot be built) torch ops."""
    if request.param == "native" and cpu_native.native_ops() is None:
        pytest.fail(f"our CPU kernels did not build: {cpu_native.unavailable_reason()}")
    if request.param == "torch":
        monkeypatch.setattr(cpu_native, "native_ops", lambda: None)
    return request.param


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
                                           padding, dtype, kernels):  # fmt: skip
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
    md.per_step.clear()
    f32 = (t.float() for t in (q, k, v, cache))
    exact, _ = _run(TorchAttentionBackend(), spec, *f32, md)
    # One-query rows attend in float32: they agree with the float32 reference to float32's
    # rounding (and bf16 inputs' output rounding).
    one_query = torch.tensor([m == 1 for m in q_lens for _ in range(m)])
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:n][one_query].float(), exact[:n][one_query], atol=tol, rtol=tol)
    # Prompt chunks attend in the dtype through SDPA's flash kernel (float accumulation), the
    # reference through its math path: about as far from the float32 reference as it is.
    if not one_query.all():
        chunk_err = (out[:n][~one_query].float() - exact[:n][~one_query]).abs().max()
        ref_err = (expected[:n][~one_query].float() - exact[:n][~one_query]).abs().max()
        assert chunk_err <= 1.5 * ref_err + 1e-4, (chunk_err, ref_err)
    if padding:
        assert not out[n:].any()
    assert out.dtype == dtype and out.shape == q.shape


def test_second_layer_of_a_step_reuses_the_step_and_matches(gen, kernels):
    q_lens, seq_lens = CASES["decode"]
    q, k, v, cache, md = paged_step(
        gen, q_lens, seq_lens, heads=8, kv_heads=2, head_dim=16, block_size=4
    )
    spec = AttentionSpec(8, 2, 16, 0.25, 6)
    backend = CpuAttentionBackend()
    first = backend.forward(spec, q, k, v, cache.clone(), md)
    assert ("cpu_decode" in md.per_step) is (kernels == "torch")  # the kernel needs no plan
    second = backend.forward(spec, q, k, v, cache.clone(), md)
    assert torch.equal(first, second)
    plain = AttentionSpec(8, 2, 16, 0.25)  # another window in the same step: its own mask
    expected = TorchAttentionBackend().forward(plain, q, k, v, cache.clone(), md)
    got = backend.forward(plain, q, k, v, cache.clone(), md)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)  # float32's rounding


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


def test_a_mixed_step_splits_once_and_batches_its_one_query_rows(gen):
    q_lens, seq_lens = CASES["mixed_with_prefix_hits"]
    q, k, v, cache, md = paged_step(
        gen, q_lens, seq_lens, heads=8, kv_heads=2, head_dim=16, block_size=4
    )
    spec = AttentionSpec(8, 2, 16, 0.25)
    backend = CpuAttentionBackend()
    first = backend.forward(spec, q, k, v, cache.clone(), md)
    plan = md.per_step["cpu_mixed"]
    assert plan.decode is not None and plan.decode.batch == 2  # sequences 0 and 2
    assert plan.decode_tokens.tolist() == [0, 13]
    assert [(i, s, e) for i, s, e, _ in plan.chunks] == [(1, 1, 13), (3, 14, 23)]
    second = backend.forward(spec, q, k, v, cache.clone(), md)
    assert md.per_step["cpu_mixed"] is plan and torch.equal(first, second)
