"""The CPU path's shortcuts give the plain path's numbers: RMSNorm's fused call in float32 is
bit-identical to the written-out math, and rotary tables shared through a step's `per_step`
dict rotate exactly as freshly built ones, for the same positions only."""

import torch

from inferengine.model.layers.norm import RMSNorm
from inferengine.model.layers.rotary import RotaryEmbedding


def test_float32_rms_norm_is_bit_identical_to_the_written_out_math():
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 96, generator=gen) * 5
        expected = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(norm(x), expected)
        residual = torch.randn(rows, 96, generator=gen)
        out, new_residual = norm(x, residual)
        assert torch.equal(new_residual, x + residual)
        assert torch.equal(out, norm(x + residual))


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
