"""The attention layer models call: reshapes heads and hands off to the selected backend."""

from __future__ import annotations

import torch
from torch import nn

from inferengine.attention.backends.base import AttentionBackend, AttentionSpec
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
    ):
        super().__init__()
        self.backend = backend
        self.spec = AttentionSpec(num_heads, num_kv_heads, head_dim, scale, sliding_window)

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq·D]
        key: torch.Tensor,  # [T, Hkv·D]
        value: torch.Tensor,  # [T, Hkv·D]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq·D]
        s = self.spec
        num_tokens = query.shape[0]
        out = self.backend.forward(
            s,
            query.view(num_tokens, s.num_heads, s.head_dim),
            key.view(num_tokens, s.num_kv_heads, s.head_dim),
            value.view(num_tokens, s.num_kv_heads, s.head_dim),
            kv_cache,
            metadata,
        )
        return out.view(num_tokens, s.num_heads * s.head_dim)
