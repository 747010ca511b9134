"""SiLU-and-mul kernel against its torch reference."""

import pytest
import torch

from inferengine.kernels.activation import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 2 * 64), (3, 2 * 1500), (2, 3, 2 * 40)])
def test_silu_and_mul(gen, device, assert_close, dtype, shape):
    x = (4 * torch.randn(shape, generator=gen)).to(dtype=dtype, device=device)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    ulps = {"atol": 1e-2, "rtol": 8e-3} if dtype == torch.bfloat16 else {"atol": 1e-3, "rtol": 1e-3}
    assert_close(out, silu_and_mul_ref(x), **(tol or ulps))


def test_silu_and_mul_into_out(gen, device, assert_close):
    x = torch.randn(4, 256, generator=gen).to(device)
    out = torch.full((4, 128), float("nan"), device=device)
    assert silu_and_mul(x, out=out) is out
    assert_close(out, silu_and_mul_ref(x), atol=1e-5, rtol=1e-5)
