"""The CPU attention backend: the torch reference's math, arranged for few and cheap CPU ops.

On a CPU every torch op costs microseconds however small its tensors, and a decode step of a
small model is thousands of them, so this backend differs from the reference (`torch_ref.py`)
only where that pays:
- decode attends in float32: torch's CPU SDPA on bfloat16 is 5-10x slower at one query a
  sequence than on float32 (oneDNN's small bf16 GEMMs). K/V pages keep the cache's dtype; the
  gathered rows are widened, which is exact, so only the attention math is more precise than
  the reference's;
- what every layer of a step shares (which pages to gather, the padding mask as an additive
  bias, whether any slot is padding) is built once per step in `metadata.per_step`.
Prefill and mixed steps take the reference's per-sequence path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferengine.attention.backends.base import AttentionSpec, RotaryInputs
from inferengine.attention.backends.torch_ref import (
    TorchAttentionBackend,
    attend,
    store_kv_torch,
)
from inferengine.attention.metadata import AttentionMetadata
from inferengine.kernels.kv_quant import as_bytes, dequantize, quantize

_STEP_KEY = "cpu_decode"


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def forward(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        rotary: RotaryInputs | None = None,
    ) -> torch.Tensor:
        if not metadata.is_decode:
            return super().forward(spec, query, key, value, kv_cache, metadata, rotary)
        step = metadata.per_step.get(_STEP_KEY)
        if step is None:
            step = metadata.per_step[_STEP_KEY] = _DecodeStep(metadata, kv_cache.shape[2])
        self._store(spec, key, value, kv_cache, metadata, step)
        return self._decode_float32(spec, query, kv_cache, metadata, step)

    @staticmethod
    def _store(
        spec: AttentionSpec,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        step: _DecodeStep,
    ) -> None:
        if step.slots is None:  # some rows are padding (slot −1): the reference drops them
            store_kv_torch(key, value, kv_cache, metadata.slot_mapping, spec.k_scale, spec.v_scale)
            return
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        flat = as_bytes(kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim))
        n = step.slots.shape[0]
        k, v = key[:n], value[:n]
        if k.dtype != kv_cache.dtype:
            k = quantize(k, spec.k_scale, kv_cache.dtype)
            v = quantize(v, spec.v_scale, kv_cache.dtype)
        flat[0].index_copy_(0, step.slots, as_bytes(k))
        flat[1].index_copy_(0, step.slots, as_bytes(v))

    @staticmethod
    def _decode_float32(
        spec: AttentionSpec,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        step: _DecodeStep,
    ) -> torch.Tensor:
        b, length = step.batch, step.length
        pages = as_bytes(kv_cache).flatten(2).index_select(1, step.page_ids)
        pages = pages.view(kv_cache.dtype).view(2, b, -1, *kv_cache.shape[3:])[:, :, :length]
        k = dequantize(pages[0], spec.k_scale, torch.float32).transpose(1, 2)  # [B, Hkv, L, D]
        v = dequantize(pages[1], spec.v_scale, torch.float32).transpose(1, 2)
        q = query[:b].unsqueeze(2).float()  # [B, Hq, 1, D]
        if spec.logits_soft_cap is None:
            bias = step.bias(spec.sliding_window)
            group = spec.num_heads // spec.num_kv_heads
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, scale=spec.scale, enable_gqa=group > 1
            )
        else:
            o = attend(q, k, v, step.mask(spec.sliding_window), spec)
        o = o[:, :, 0].to(query.dtype)
        if query.shape[0] == b:
            return o
        out = torch.zeros_like(query)  # padding rows stay zero
        out[:b] = o
        return out


class _DecodeStep:
    """What every layer of one decode step shares: the pages to gather, the padding masks."""

    def __init__(self, metadata: AttentionMetadata, block_size: int):
        self.batch = metadata.num_seqs
        self.length = metadata.max_seq_len
        num_blocks = -(-self.length // block_size)
        self.page_ids = metadata.block_table[:, :num_blocks].long().flatten()
        slot_mapping = metadata.slot_mapping
        self.slots = slot_mapping if bool((slot_mapping >= 0).all()) else None
        self._seq_lens = metadata.seq_lens.unsqueeze(1)
        self._masks: dict[int | None, torch.Tensor] = {}
        self._biases: dict[int | None, torch.Tensor] = {}

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """[B, 1, 1, L] True where a sequence's query may see key position j."""
        if sliding_window not in self._masks:
            k_pos = torch.arange(self.length, device=self._seq_lens.device)
            mask = k_pos < self._seq_lens
            if sliding_window is not None:
                mask &= k_pos > self._seq_lens - 1 - sliding_window
            self._masks[sliding_window] = mask[:, None, None, :]
        return self._masks[sliding_window]

    def bias(self, sliding_window: int | None) -> torch.Tensor:
        """The mask as a float32 bias (0 where visible, −inf elsewhere)."""
        if sliding_window not in self._biases:
            mask = self.mask(sliding_window)
            bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
            self._biases[sliding_window] = bias.masked_fill_(~mask, float("-inf"))
        return self._biases[sliding_window]
