"""Write new tokens' keys and values into their KV cache pages (Triton + torch reference)."""

import torch

from inferengine.kernels.triton_utils import next_power_of_2


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at
    slot_mapping [T] (slot = block_id * block_size + offset); slot -1 marks a padded token."""
    from inferengine.kernels.fused_kernels import store_kv_kernel

    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1
    head_dim_pad = next_power_of_2(head_dim)
    heads_per_program = min(next_power_of_2(num_kv_heads), max(1, 2048 // head_dim_pad))
    grid = (num_tokens, -(-num_kv_heads // heads_per_program))
    store_kv_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        HEADS_PER_PROGRAM=heads_per_program,
        num_warps=4,
    )


def store_kv_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference of `store_kv`."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[keep].to(kv_cache.dtype)
