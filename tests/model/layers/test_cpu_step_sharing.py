"""The CPU path's shortcuts give the plain path's numbers: RMSNorm in float32 (torch's fused
call bit-identical to the written-out math, our C++ kernel to float32 rounding, in place like
the CUDA kernel), and rotary tables shared through a step's `per_step` dict rotate exactly as
freshly built ones, for the same positions only."""

import pytest
import torch

from inferengine.kernels import cpu_native
from inferengine.model.layers.norm import RMSNorm
from inferengine.model.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_float32_rms_norm_equals_the_written_out_math(monkeypatch, kernels):
    if kernels == "torch":
        monkeypatch.setattr(cpu_native, "native_ops", lambda: None)
    elif cpu_native.native_ops() is None:
        pytest.skip(f"no CPU kernels: {cpu_native.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=gen)

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        if kernels == "torch":
            assert torch.equal(a, b)
        else:  # another summation order of the squares
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    for rows in (1, 7, 300):
        x = torch.randn(rows, 96, generator=gen) * 5
        expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        same(norm(x), expected)
        residual = torch.randn(rows, 96, generator=gen)
        added = x + residual
        expected = norm(added.clone())
        out, new_residual = norm(x, residual)
        assert torch.equal(new_residual, added)
        same(out, expected)


def test_rotary_tables_kept_for_a_step_rotate_like_fresh_ones():
    gen = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(32, 256, {"rope_theta": 10000.0})
    positions = torch.tensor([0, 5, 17, 200])
    per_step: dict = {}
    q, k = torch.randn(4, 4 * 32, generator=gen), torch.randn(4, 2 * 32, generator=gen)
    fresh = rope(positions, q, k)
    first = rope(positions, q, k, per_step)
    assert len(per_step) == 1
    second = rope(positions, q * 2, k * 2, per_step)  # another layer of the step
    for a, b in zip(fresh, first, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(fresh, second, strict=True):
        assert torch.equal(a * 2, b)
    # Other positions (another tensor) never take the kept tables.
    other = torch.tensor([1, 2, 3, 4])
    assert torch.equal(rope(other, q, k, per_step)[0], rope(other, q, k)[0])
