"""KV-cache store kernel against its torch reference."""

import pytest
import torch

from inferengine.kernels.kv_store import store_kv, store_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"),
    [(2, 64, 16), (1, 128, 32), (3, 96, 16), (2, 8, 16), (1, 80, 16), (2, 192, 32)],
)
def test_store_kv_matches_reference(gen, device, dtype, num_kv_heads, head_dim, block_size):
    num_tokens, num_blocks, num_q_heads = 11, 6, 2 * num_kv_heads
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1
    # key and value as head slices of one fused QKV row, like the attention layer passes them.
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen)
    qkv = qkv.to(dtype=dtype, device=device)
    key = qkv[:, num_q_heads : num_q_heads + num_kv_heads]
    value = qkv[:, num_q_heads + num_kv_heads :]
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    expected = cache.clone()

    store_kv(key, value, cache, slots.to(device))
    store_kv_ref(key, value, expected, slots.to(device))

    torch.testing.assert_close(cache, expected, equal_nan=True, rtol=0, atol=0)
    written = ~cache.isnan().view(2, -1, num_kv_heads * head_dim).all(-1)
    assert written.sum().item() == 2 * (num_tokens - 2)


def test_store_kv_all_padded_and_empty(gen, device):
    cache = torch.zeros(2, 3, 16, 1, 64, device=device)
    key = torch.randn(4, 1, 64, generator=gen).to(device)
    store_kv(key, key, cache, torch.full((4,), -1, dtype=torch.int64, device=device))
    store_kv(key[:0], key[:0], cache, torch.empty(0, dtype=torch.int64, device=device))
    assert cache.eq(0).all()


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(4, 2, 64), (7, 1, 128), (4, 1, 8), (16, 1, 16), (2, 2, 256)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_kv_matches_rotary_then_store(
    gen, device, dtype, num_q_heads, num_kv_heads, head_dim
):
    """Fused rotary + KV store equals rotating q and k, then storing k and v; q and k are
    rotated in place inside a fused QKV row, padded slots write nothing."""
    from inferengine.kernels.kv_store import rotary_store_kv, rotary_store_kv_ref
    from inferengine.kernels.rotary import compute_cos_sin_cache

    num_tokens, block_size, num_blocks = 6, 16, 5
    sizes = [num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes), generator=gen).to(device, dtype)
    qkv_ref = qkv.clone()
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = compute_cos_sin_cache(inv_freq, 512).to(device)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(device)
    slots = torch.tensor([3, 17, -1, 40, 79, 0], device=device)
    cache = torch.full(
        (2, num_blocks, block_size, num_kv_heads, head_dim),
        float("nan"),
        dtype=dtype,
        device=device,
    )
    cache_ref = cache.clone()

    def heads(t):
        q, k, v = t.split(sizes, dim=-1)
        return (q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim),
                v.view(num_tokens, num_kv_heads, head_dim))  # fmt: skip

    rotary_store_kv(positions, *heads(qkv), cache, slots, cos_sin)
    rotary_store_kv_ref(positions, *heads(qkv_ref), cache_ref, slots, cos_sin)
    torch.testing.assert_close(qkv, qkv_ref)
    torch.testing.assert_close(cache, cache_ref, equal_nan=True)
