"""The attention backend interface: store new K/V into the pages, then attend over them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from inferengine.attention.metadata import AttentionMetadata


class Rotary(Protocol):
    """What attention asks of a rotary embedding (`model/layers/rotary.RotaryEmbedding`)."""

    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim] float32: cos | sin

    def fusable_into_kv_store(self, query: torch.Tensor) -> bool: ...

    def __call__(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        per_step: dict[Any, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class RotaryInputs:
    """Rotary embedding a backend that `takes_rotary` applies while storing K/V: NeoX halves
    of whole heads, cos | sin rows of `cos_sin_cache` picked by `positions`."""

    positions: torch.Tensor  # [T]
    cos_sin_cache: torch.Tensor  # [max_position, head_dim] float32


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None
    # Gemma 2's attention logit soft-capping: scores become cap · tanh(scores / cap) (after the
    # scale, before the mask and softmax). Every backend implements it.
    logits_soft_cap: float | None = None
    # An fp8 KV cache stores K / k_scale and V / v_scale (kernels/kv_quant.py); every backend
    # applies them when the cache it is given is fp8 and ignores them otherwise.
    k_scale: float = 1.0
    v_scale: float = 1.0
    # False: every query sees every key of its sequence (encoders, `model/bert.py`; the cpu and
    # torch backends only, over whole prompts)
    causal: bool = True


class AttentionBackend(ABC):
    name: str
    # True when a forward reads no device value on the host, so a step can be a CUDA graph.
    cuda_graph_safe: bool = False
    # True when forward can take `rotary` and rotate the (unrotated) query and key itself.
    fuses_rotary: bool = False

    def takes_rotary(
        self,
        rotary_emb: Rotary,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> bool:
        """Whether this forward should get `rotary` (unrotated query and key) rather than
        rotated ones."""
        return self.fuses_rotary and rotary_emb.fusable_into_kv_store(query)

    @abstractmethod
    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,  # [T, Hq, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        rotary: RotaryInputs | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write `key`/`value` into their slots, then attend each query over its context.
        With `rotary` (only where `takes_rotary` said so), rotate query and key first."""
