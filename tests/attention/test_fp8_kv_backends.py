"""The torch reference and FlexAttention backends over an fp8 KV cache with scales: they store
what the store kernel's reference stores, and attend as over a full-precision cache holding the
values fp8 rounds them to. The selector keeps flex off fp8 on CUDA."""

import zlib

import pytest
import torch

from inferengine.attention.autotune import AttentionShape
from inferengine.attention.backends.base import AttentionSpec
from inferengine.attention.backends.flex import FlexAttentionBackend, flex_available
from inferengine.attention.backends.torch_ref import TorchAttentionBackend
from inferengine.attention.selector import get_attention_backend, usable_backends
from inferengine.errors import ConfigError
from inferengine.kernels.kv_quant import as_bytes, dequantize, quantize
from inferengine.kernels.kv_store import store_kv_ref
from tests.attention.test_flex_backend import CASES, paged_step

E4M3, E5M2, F32 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float32
K_SCALE, V_SCALE = 0.6, 0.2
BACKENDS = {"torch": TorchAttentionBackend}
if flex_available():
    BACKENDS["flex"] = FlexAttentionBackend


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _through_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return dequantize(quantize(x, scale, dtype), scale, F32)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize(("sliding_window", "cap"), [(None, None), (6, None), (None, 3.0)])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_over_fp8_pages(gen, backend, case, sliding_window, cap, cache_dtype):
    q_lens, seq_lens = CASES[case]
    q, k, v, cache, md = paged_step(
        gen, q_lens, seq_lens, heads=8, kv_heads=2, head_dim=16, block_size=4, shared_pages=1,
        padding=3,
    )  # fmt: skip
    q, k, v = q * 2, k * 30, v * 30  # the scales matter: values well away from 1
    fp8 = torch.stack(
        [quantize(cache[0], K_SCALE, cache_dtype), quantize(cache[1], V_SCALE, cache_dtype)]
    )
    stored = fp8.clone()
    store_kv_ref(k, v, stored, md.slot_mapping, K_SCALE, V_SCALE)

    spec = AttentionSpec(8, 2, 16, 0.25, sliding_window, cap, k_scale=K_SCALE, v_scale=V_SCALE)
    out = BACKENDS[backend]().forward(spec, q, k, v, fp8, md)

    assert torch.equal(as_bytes(fp8), as_bytes(stored))
    full = torch.stack([dequantize(fp8[0], K_SCALE, F32), dequantize(fp8[1], V_SCALE, F32)])
    k_full, v_full = _through_fp8(k, K_SCALE, cache_dtype), _through_fp8(v, V_SCALE, cache_dtype)
    unscaled = AttentionSpec(8, 2, 16, 0.25, sliding_window, cap)
    expected = TorchAttentionBackend().forward(unscaled, q, k_full, v_full, full, md)
    n = md.num_actual_tokens
    torch.testing.assert_close(out[:n], expected[:n], atol=1e-3, rtol=1e-3)


def test_the_scales_are_ignored_by_a_full_precision_cache(gen):
    q_lens, seq_lens = CASES["mixed_with_prefix_hits"]
    q, k, v, cache, md = paged_step(
        gen, q_lens, seq_lens, heads=8, kv_heads=2, head_dim=16, block_size=4
    )
    scaled = AttentionSpec(8, 2, 16, 0.25, k_scale=K_SCALE, v_scale=V_SCALE)
    out = TorchAttentionBackend().forward(scaled, q, k, v, cache.clone(), md)
    plain = TorchAttentionBackend().forward(AttentionSpec(8, 2, 16, 0.25), q, k, v, cache, md)
    assert torch.equal(out, plain)


def test_flex_is_not_offered_for_fp8_on_cuda():
    fp8 = AttentionShape(8, 2, 64, 16, torch.bfloat16, kv_cache_dtype=E4M3)
    assert "flex" not in usable_backends("cuda", fp8)
    with pytest.raises(ConfigError, match="fp8 KV cache on CUDA"):
        get_attention_backend("flex", "cuda", fp8)
    if flex_available():
        assert "flex" in usable_backends("cpu", fp8)
    key = fp8.key(torch.device("cpu"))
    assert "kv torch.float8_e4m3fn" in key
    assert "kv" not in AttentionShape(8, 2, 64, 16, torch.bfloat16).key(torch.device("cpu"))
