"""Write new tokens' keys and values into their KV cache pages, optionally rotating the keys on
the way (Triton + torch references). An fp8 cache stores clamp(x / scale) (`kv_quant`)."""

import torch

from inferengine.kernels.kv_quant import as_bytes, fp8_max, is_fp8, quantize
from inferengine.kernels.triton_utils import next_power_of_2, pdl_launch


def _quant_args(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> dict:
    quant = is_fp8(kv_cache.dtype)
    return dict(
        k_scale=k_scale if quant else 1.0,
        v_scale=v_scale if quant else 1.0,
        QUANT=quant,
        FP8_MAX=fp8_max(kv_cache.dtype) if quant else 0.0,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] at
    slot_mapping [T] (slot = block_id * block_size + offset); slot -1 marks a padded token.
    An fp8 cache gets key / k_scale and value / v_scale, saturated."""
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
        **_quant_args(kv_cache, k_scale, v_scale),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        HEADS_PER_PROGRAM=heads_per_program,
        num_warps=4,
        **pdl_launch(key),
    )


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Torch reference of `store_kv`."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    cache = as_bytes(kv_cache)
    cache[0, blocks, offsets] = as_bytes(quantize(key[keep], k_scale, kv_cache.dtype))
    cache[1, blocks, offsets] = as_bytes(quantize(value[keep], v_scale, kv_cache.dtype))


def rotary_store_kv_supported(head_dim: int, rotary_dim: int) -> bool:
    """The fused kernel rotates NeoX halves of whole heads whose half is a power of two."""
    half = head_dim // 2
    return rotary_dim == head_dim and head_dim % 2 == 0 and next_power_of_2(half) == half


def rotary_store_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """`rotary_embedding` of query [T, Hq, D] and key [T, Hkv, D] in place and `store_kv` of
    the rotated key and value, in one launch (padded tokens, slot -1: query only). NeoX
    rotation of whole heads (see `rotary_store_kv_supported`); cos_sin_cache
    [max_position, D] is cos | sin. `key` keeps the rotated values unquantized."""
    from inferengine.kernels.fused_kernels import rotary_store_kv_kernel

    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0:
        return
    assert rotary_store_kv_supported(head_dim, cos_sin_cache.shape[-1])
    assert query.stride(2) == 1 and key.stride(2) == 1 and value.stride(2) == 1
    assert kv_cache.stride(4) == 1 and cos_sin_cache.stride(-1) == 1
    rotary_store_kv_kernel[(num_tokens,)](
        positions, query, key, value, cos_sin_cache, kv_cache, slot_mapping,
        num_q_heads, num_kv_heads,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), cos_sin_cache.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        **_quant_args(kv_cache, k_scale, v_scale),
        BLOCK_SIZE=kv_cache.shape[2],
        HALF=head_dim // 2,
        Q_HEADS_PAD=next_power_of_2(num_q_heads),
        K_HEADS_PAD=next_power_of_2(num_kv_heads),
        num_warps=4,
        **pdl_launch(query),
    )  # fmt: skip


def rotary_store_kv_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Torch reference of `rotary_store_kv`."""
    from inferengine.kernels.rotary import rotary_embedding_ref

    keep = slot_mapping >= 0
    rotated_key = key.clone()
    rotary_embedding_ref(positions, query, rotated_key, cos_sin_cache, query.shape[-1])
    key[keep] = rotated_key[keep]
    store_kv_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)
