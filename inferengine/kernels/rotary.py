"""Rotary position embedding applied in place to the query and key parts of a QKV projection
(Triton + torch reference)."""

import torch

from inferengine.kernels.triton_utils import next_power_of_2, pdl_launch


def _heads(x: torch.Tensor, head_dim: int) -> tuple[int, int]:
    """(number of heads, head stride) of a [T, H*D] or [T, H, D] tensor with a dense last dim."""
    assert x.stride(-1) == 1, "the last dim must be dense"
    if x.dim() == 2:
        return x.shape[1] // head_dim, head_dim
    return x.shape[1], x.stride(1)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, Hq*D] and key [T, Hkv*D] (or [T, H, D]) in place at `positions` [T].
    Views into a fused QKV output work: `q, k, v = qkv.split([Hq*D, Hkv*D, Hkv*D], dim=-1)`.
    cos_sin_cache [max_position, rotary_dim] holds cos in its first half and sin in its second;
    the first rotary_dim dims of each head rotate (NeoX: halves; GPT-J: even/odd pairs)."""
    from inferengine.kernels.fused_kernels import rotary_kernel

    num_tokens = positions.shape[0]
    if num_tokens == 0:
        return query, key
    num_q_heads, stride_qh = _heads(query, head_dim)
    num_kv_heads, stride_kh = _heads(key, head_dim)
    half = cos_sin_cache.shape[-1] // 2
    assert cos_sin_cache.stride(-1) == 1
    rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        cos_sin_cache,
        num_q_heads,
        num_kv_heads,
        query.stride(0),
        stride_qh,
        key.stride(0),
        stride_kh,
        cos_sin_cache.stride(0),
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        Q_HEADS_PAD=next_power_of_2(num_q_heads),
        K_HEADS_PAD=next_power_of_2(num_kv_heads),
        IS_NEOX=is_neox,
        num_warps=4,
        **pdl_launch(query),
    )
    return query, key


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `rotary_embedding`, in place like it."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()].float()
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_dim) if x.dim() == 2 else x
        rot = heads[..., : 2 * half]
        if is_neox:
            x1, x2 = rot[..., :half].float(), rot[..., half:].float()
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2].float(), rot[..., 1::2].float()
            rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        rot.copy_(rotated.to(x.dtype))
    return query, key


def compute_cos_sin_cache(
    inv_freq: torch.Tensor, max_position: int, attention_scaling: float = 1.0
) -> torch.Tensor:
    """[max_position, rotary_dim] float32 cos|sin table computed like HF's rotary embedding
    (positions times inverse frequencies in float32, scaled by `attention_scaling`)."""
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_scaling
