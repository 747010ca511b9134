"""The attention layer models call: reshapes heads and hands off to the selected backend."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from inferengine.attention.backends.base import (
    AttentionBackend,
    AttentionSpec,
    Rotary,
    RotaryInputs,
)
from inferengine.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    def __init__(
        self,
        backend: AttentionBackend,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ):
        super().__init__()
        self.backend = backend
        self.spec = AttentionSpec(
            num_heads, num_kv_heads, head_dim, scale, sliding_window, logits_soft_cap or None
        )

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """The checkpoint's fp8 KV cache scales for this layer (default 1.0)."""
        self.spec = dataclasses.replace(self.spec, k_scale=k_scale, v_scale=v_scale)

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq·D]
        key: torch.Tensor,  # [T, Hkv·D]
        value: torch.Tensor,  # [T, Hkv·D]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        positions: torch.Tensor | None = None,
        rotary_emb: Rotary | None = None,
    ) -> torch.Tensor:  # [T, Hq·D]
        """With `rotary_emb`, query and key come unrotated: the backend rotates them while
        storing K/V where it can (one kernel fewer per layer), else they are rotated here."""
        s = self.spec
        num_tokens = query.shape[0]
        fused_rotary = None
        if rotary_emb is not None:
            assert positions is not None
            if self.backend.takes_rotary(rotary_emb, query, kv_cache, metadata):
                fused_rotary = RotaryInputs(positions, rotary_emb.cos_sin_cache)
            else:
                query, key = rotary_emb(positions, query, key, metadata.per_step)
        out = self.backend.forward(
            s,
            query.view(num_tokens, s.num_heads, s.head_dim),
            key.view(num_tokens, s.num_kv_heads, s.head_dim),
            value.view(num_tokens, s.num_kv_heads, s.head_dim),
            kv_cache,
            metadata,
            fused_rotary,
        )
        return out.view(num_tokens, s.num_heads * s.head_dim)
