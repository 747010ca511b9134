"""Rotary embedding kernel against its torch reference."""

import pytest
import torch

from inferengine.kernels.rotary import compute_cos_sin_cache, rotary_embedding, rotary_embedding_ref


def inv_freq(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [(4, 2, 64, 64), (7, 1, 128, 128), (2, 2, 96, 32), (4, 1, 8, 8), (2, 1, 80, 80)],
)
def test_rotary_on_fused_qkv(
    gen, device, assert_close, dtype, is_neox, num_q_heads, num_kv_heads, head_dim, rotary_dim
):
    num_tokens, max_position = 9, 4096
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(
        dtype=dtype, device=device
    )
    cos_sin = compute_cos_sin_cache(inv_freq(rotary_dim).to(device), max_position)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(device)
    expected = qkv.clone()

    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    v_before = v.clone()
    rotary_embedding(positions, q, k, cos_sin, head_dim, is_neox)
    q_ref, k_ref, _ = expected.split([q_size, kv_size, kv_size], dim=-1)
    rotary_embedding_ref(positions, q_ref, k_ref, cos_sin, head_dim, is_neox)

    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {}
    assert_close(q, q_ref, **tolerance)
    assert_close(k, k_ref, **tolerance)
    assert torch.equal(v, v_before)


def test_rotary_3d_views_and_int32_positions(gen, device, assert_close):
    q = torch.randn(5, 4, 64, generator=gen).to(device)
    k = torch.randn(5, 2, 64, generator=gen).to(device)
    cos_sin = compute_cos_sin_cache(inv_freq(64).to(device), 128)
    positions = torch.tensor([0, 1, 2, 100, 127], dtype=torch.int32, device=device)
    q_ref, k_ref = rotary_embedding_ref(positions, q.clone(), k.clone(), cos_sin, 64)
    rotary_embedding(positions, q, k, cos_sin, 64)
    assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    # Position 0 is the identity.
    assert_close(q[0], q_ref[0], atol=0, rtol=0)


def test_cos_sin_cache_matches_hf_formula():
    freqs = inv_freq(8)
    cache = compute_cos_sin_cache(freqs, 16)
    t = torch.arange(16, dtype=torch.float32)[:, None] * freqs[None, :]
    torch.testing.assert_close(cache, torch.cat([t.cos(), t.sin()], dim=-1), rtol=0, atol=0)
