"""The CPU attention backend: the torch reference's math, arranged for few and cheap CPU ops.

On a CPU every torch op costs microseconds however small its tensors, and a decode step of a
small model is thousands of them, so this backend differs from the reference (`torch_ref.py`)
only where that pays:
- where our C++ kernels load (`kernels/cpu_native.py`), a decode step is one of them per
  layer: it rotates the new query and key, stores K/V into their pages and attends over the
  pages as they lie, in float32 (`kernels/csrc/decode_attention.cpp`); otherwise:
- sequences with one query token (every sequence of a decode step, and the decoding sequences
  of a step that also prefills) attend together, in one SDPA call over their gathered K/V
  rows, in float32: torch's CPU SDPA on bfloat16 is 5-10x slower at one query a sequence
  than on float32 (oneDNN's small bf16 GEMMs). K/V pages keep the cache's dtype; the gathered
  rows are widened, which is exact, so only the attention math is more precise than the
  reference's;
- what every layer of a step shares (which K/V rows to gather, the padding mask as an
  additive bias, whether any slot is padding, which sequences have one query) is built once
  per step in `metadata.per_step`;
- a sequence with several query tokens (a prompt or a chunk of one) attends on its own, as in
  the reference, but through SDPA's batched (4-D) form, which takes torch's flash kernel for
  the CPU instead of the math fallback a 3-D call gets (1.6x faster for a 128-token prompt).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from inferengine.attention.backends.base import AttentionSpec, Rotary, RotaryInputs
from inferengine.attention.backends.torch_ref import (
    TorchAttentionBackend,
    attend,
    attend_chunk,
    store_kv_torch,
)
from inferengine.attention.metadata import AttentionMetadata
from inferengine.kernels.cpu_native import cpu_ops
from inferengine.kernels.kv_quant import as_bytes, dequantize, quantize

_DECODE_KEY = "cpu_decode"
_MIXED_KEY = "cpu_mixed"


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def takes_rotary(
        self,
        rotary_emb: Rotary,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> bool:
        """A decode step our C++ kernel runs rotates its query and key there."""
        return (
            rotary_emb.cos_sin_cache.dtype == torch.float32
            and _native_decode(query, kv_cache, metadata) is not None
        )

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
            return self._mixed(spec, query, key, value, kv_cache, metadata)
        ops = _native_decode(query, kv_cache, metadata)
        if ops is not None:
            return ops.decode_attention(
                query,
                key,
                value,
                kv_cache,
                metadata.slot_mapping,
                metadata.block_table,
                metadata.seq_lens,
                None if rotary is None else rotary.positions,
                None if rotary is None else rotary.cos_sin_cache,
                spec.scale,
                spec.sliding_window or 0,
                spec.logits_soft_cap or 0.0,
            )
        step = metadata.per_step.get(_DECODE_KEY)
        if step is None:
            step = metadata.per_step[_DECODE_KEY] = _DecodeStep.of_decode(metadata, kv_cache)
        self._store(spec, key, value, kv_cache, metadata, step)
        o = _attend_one_query_each(spec, query[: step.batch], kv_cache, step)
        if query.shape[0] == step.batch:
            return o
        out = torch.zeros_like(query)  # padding rows stay zero
        out[: step.batch] = o
        return out

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
    def _mixed(
        spec: AttentionSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """A step with prompt chunks: one-query sequences together, the others one by one."""
        store_kv_torch(key, value, kv_cache, metadata.slot_mapping, spec.k_scale, spec.v_scale)
        plan = metadata.per_step.get(_MIXED_KEY)
        if plan is None:
            plan = metadata.per_step[_MIXED_KEY] = _MixedStep(metadata, kv_cache)
        out = torch.zeros_like(query)
        if plan.decode is not None:
            rows = query.index_select(0, plan.decode_tokens)
            out.index_copy_(
                0, plan.decode_tokens, _attend_one_query_each(spec, rows, kv_cache, plan.decode)
            )
        for i, q_start, q_end, seq_len in plan.chunks:
            chunk = query[q_start:q_end]
            table = metadata.block_table[i]
            out[q_start:q_end] = attend_chunk(spec, chunk, kv_cache, table, seq_len, batched=True)
        return out


def _native_decode(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata
) -> Any | None:
    """Our C++ kernels, where they run this step: a decode step without padding rows, over a
    cache of a dtype they read."""
    if not metadata.is_decode or query.shape[0] != metadata.num_seqs:
        return None
    if kv_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return cpu_ops(query)


def _attend_one_query_each(
    spec: AttentionSpec, query: torch.Tensor, kv_cache: torch.Tensor, step: _DecodeStep
) -> torch.Tensor:
    """query [B, Hq, D], one token of each of the step's B sequences → [B, Hq, D], attending
    in float32 over their K/V, gathered row by row into head-major [B, Hkv, L, D]: SDPA reads
    that contiguous layout 1.3-1.5x faster than a transposed view of whole gathered pages,
    which more than pays for gathering 256-byte rows instead of pages."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    rows = step.rows(num_kv_heads)
    flat = as_bytes(kv_cache).view(2, -1, head_dim)  # one row per (slot, K/V head)
    shape = (step.batch, num_kv_heads, step.length, head_dim)
    k = flat[0].index_select(0, rows).view(kv_cache.dtype).view(shape)  # [B, Hkv, L, D]
    v = flat[1].index_select(0, rows).view(kv_cache.dtype).view(shape)
    k = dequantize(k, spec.k_scale, torch.float32)
    v = dequantize(v, spec.v_scale, torch.float32)
    q = query.unsqueeze(2).float()  # [B, Hq, 1, D]
    if spec.logits_soft_cap is None:
        bias = step.bias(spec.sliding_window)
        group = spec.num_heads // spec.num_kv_heads
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, scale=spec.scale, enable_gqa=group > 1
        )
    else:
        o = attend(q, k, v, step.mask(spec.sliding_window), spec)
    return o[:, :, 0].to(query.dtype)


class _DecodeStep:
    """What every layer of one step shares about its one-query sequences: the K/V rows to
    gather, the padding masks (and, in a decode step, the slots their K/V go to)."""

    def __init__(
        self,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        length: int,
        block_size: int,
        slots: torch.Tensor | None = None,
    ):
        self.batch = seq_lens.shape[0]
        self.length = length
        self.block_size = block_size
        num_blocks = -(-length // block_size)
        self.page_ids = block_table[:, :num_blocks].long()
        self.slots = slots
        self._rows: dict[int, torch.Tensor] = {}
        self._seq_lens = seq_lens.unsqueeze(1)
        self._masks: dict[int | None, torch.Tensor] = {}
        self._biases: dict[int | None, torch.Tensor] = {}

    @classmethod
    def of_decode(cls, metadata: AttentionMetadata, kv_cache: torch.Tensor) -> _DecodeStep:
        slot_mapping = metadata.slot_mapping
        slots = slot_mapping if bool((slot_mapping >= 0).all()) else None
        return cls(
            metadata.block_table,
            metadata.seq_lens,
            metadata.max_seq_len,
            kv_cache.shape[2],
            slots,
        )

    def rows(self, num_kv_heads: int) -> torch.Tensor:
        """[B·Hkv·L] row indices into a cache viewed as [slots · Hkv, D]: sequence b's K/V
        head h at position j is row (slot(b, j) · Hkv + h)."""
        if num_kv_heads not in self._rows:
            offsets = torch.arange(self.block_size, device=self.page_ids.device)
            slots = (self.page_ids[:, :, None] * self.block_size + offsets).flatten(1)
            slots = slots[:, : self.length]  # [B, L]
            heads = torch.arange(num_kv_heads, device=slots.device)[None, :, None]
            self._rows[num_kv_heads] = (slots[:, None, :] * num_kv_heads + heads).flatten()
        return self._rows[num_kv_heads]

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


class _MixedStep:
    """A step with prompt chunks, split once for every layer: its one-query sequences (a
    `_DecodeStep` over their rows, and their token indices) and the other sequences' chunks
    (sequence, first and end token, context length)."""

    def __init__(self, metadata: AttentionMetadata, kv_cache: torch.Tensor):
        starts = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        if starts is None or seq_lens is None:
            starts = metadata.query_start_loc.tolist()
            seq_lens = metadata.seq_lens.tolist()
        ones = [i for i, n in enumerate(seq_lens) if starts[i + 1] - starts[i] == 1]
        self.chunks = [
            (i, starts[i], starts[i + 1], n)
            for i, n in enumerate(seq_lens)
            if starts[i + 1] - starts[i] > 1
        ]
        self.decode: _DecodeStep | None = None
        self.decode_tokens = torch.tensor([starts[i] for i in ones], dtype=torch.long)
        if ones:
            rows = torch.tensor(ones, dtype=torch.long, device=metadata.seq_lens.device)
            self.decode = _DecodeStep(
                metadata.block_table.index_select(0, rows),
                metadata.seq_lens.index_select(0, rows),
                max(seq_lens[i] for i in ones),
                kv_cache.shape[2],
            )
            self.decode_tokens = self.decode_tokens.to(metadata.seq_lens.device)
