"""KV-cache store kernel against its torch reference."""

import pytest
import torch

from inferengine.kernels.kv_store import store_kv, store_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size"), [(2, 64, 16), (1, 128, 32), (3, 96, 16)]
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
