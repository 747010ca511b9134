"""RMSNorm kernels against torch references of Hugging Face's math."""

import pytest
import torch

from inferengine.kernels.norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)

# Same math, different summation order and sqrt: allow one or two ulps of the output dtype.
ULPS = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 300), (2, 3, 128)])
def test_rms_norm(gen, device, assert_close, dtype, shape):
    x = (3 * torch.randn(shape, generator=gen)).to(dtype=dtype, device=device)
    weight = torch.randn(shape[-1], generator=gen).to(dtype=dtype, device=device)
    out = rms_norm(x, weight, 1e-6)
    assert out.shape == x.shape
    assert_close(out, rms_norm_ref(x, weight, 1e-6), **ULPS[dtype])


def test_rms_norm_strided_rows(gen, device, assert_close):
    wide = torch.randn(5, 200, generator=gen).to(device)
    weight = torch.randn(128, generator=gen).to(device)
    x = wide[:, 10:138]
    assert_close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), **ULPS[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "head_dim"), [(32, 128), (5, 80), (3, 256), (1, 8)])
def test_rms_norm_heads_of_a_qkv_split(gen, device, assert_close, dtype, num_heads, head_dim):
    """q/k norm: the heads of a slice of the fused qkv output (token stride > heads x dim),
    read where they lie; every head is normalised on its own."""
    tokens, kv = 6, 2
    qkv = torch.randn(tokens, (num_heads + 2 * kv) * head_dim, generator=gen).to(
        device=device, dtype=dtype
    )
    weight = torch.randn(head_dim, generator=gen).to(dtype=dtype, device=device)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + kv) * head_dim].view(tokens, kv, head_dim)
    for x in (q, k):
        before = qkv.clone()
        out = rms_norm(x, weight, 1e-6)
        assert out.shape == x.shape and out.is_contiguous()
        assert_close(out, rms_norm_ref(x, weight, 1e-6), **ULPS[dtype])
        torch.testing.assert_close(qkv, before, rtol=0, atol=0)  # the input is left as it was


def test_rms_norm_heads_empty(device):
    x = torch.zeros(0, 4, 64, device=device)
    assert rms_norm(x, torch.ones(64, device=device), 1e-6).shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 64), (3, 300)])
def test_fused_add_rms_norm_in_place(gen, device, assert_close, dtype, shape):
    x = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    residual = torch.randn(shape, generator=gen).to(dtype=dtype, device=device)
    weight = torch.randn(shape[-1], generator=gen).to(dtype=dtype, device=device)
    x_ref, residual_ref = fused_add_rms_norm_ref(x.clone(), residual.clone(), weight, 1e-6)

    out, res = fused_add_rms_norm(x, residual, weight, 1e-6)

    assert out is x and res is residual
    # The residual sum is one rounding of an exact sum: identical.
    torch.testing.assert_close(residual, residual_ref, rtol=0, atol=0)
    assert_close(x, x_ref, **ULPS[dtype])
