"""The reference attention backend in plain torch: clear, slow, runs anywhere.

It gathers each sequence's pages into a dense K/V and calls SDPA with an explicit causal mask
(or, with logit soft-capping, which SDPA lacks, the same math written out as Transformers' eager
attention does it); the Triton kernels are tested against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inferengine.attention.backends.base import AttentionBackend, AttentionSpec, RotaryInputs
from inferengine.attention.metadata import AttentionMetadata
from inferengine.kernels.kv_quant import as_bytes, dequantize, quantize


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write K/V rows into their flat slots, skipping padded tokens (slot −1); an fp8 cache
    gets them quantized with the scales."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = as_bytes(kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim))
    n = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    flat[0].index_copy_(0, slots, as_bytes(quantize(key[:n][valid], k_scale, kv_cache.dtype)))
    flat[1].index_copy_(0, slots, as_bytes(quantize(value[:n][valid], v_scale, kv_cache.dtype)))


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V, [seq_len, Hkv, D] each, read through its block table (as
    stored: `dequantize` an fp8 cache's)."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    pages = as_bytes(kv_cache).index_select(1, block_ids[:num_blocks].long())  # [2, n, bs, H, D]
    pages = pages.view(kv_cache.dtype).flatten(1, 2)[:, :seq_len]
    return pages[0], pages[1]


def causal_mask(
    q_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """[q_len, seq_len] True where query i (at position seq_len − q_len + i) may see key j."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


_HAS_ENABLE_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, group: int
) -> torch.Tensor:
    """SDPA where each K/V head serves `group` query heads (heads on dim -3)."""
    if group > 1 and _HAS_ENABLE_GQA:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    spec: AttentionSpec,
) -> torch.Tensor:
    """Attention of q [..., Hq, L, D] over k/v [..., Hkv, S, D] where `mask` is True: SDPA, or
    with `spec.logits_soft_cap` scores capped to cap · tanh(s / cap) before mask and softmax
    (Transformers' eager order of operations: float32 softmax, probabilities in q's dtype)."""
    group = spec.num_heads // spec.num_kv_heads
    cap = spec.logits_soft_cap
    if cap is None:
        return sdpa_gqa(q, k, v, mask, spec.scale, group)
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)
        v = v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def attend_chunk(
    spec: AttentionSpec,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    seq_len: int,
    batched: bool = False,
) -> torch.Tensor:
    """query [q_len, Hq, D], the last q_len tokens of a sequence of `seq_len`, attending
    causally over its pages → [q_len, Hq, D]. `batched`: SDPA's 4-D form, which takes torch's
    CPU flash kernel; the 3-D form (the reference's) takes the math path."""
    k, v = gather_kv(kv_cache, block_ids, seq_len)
    k = dequantize(k, spec.k_scale, query.dtype).transpose(0, 1)  # [Hkv, S, D]
    v = dequantize(v, spec.v_scale, query.dtype).transpose(0, 1)
    q = query.transpose(0, 1)  # [Hq, q_len, D]
    mask = causal_mask(query.shape[0], seq_len, spec.sliding_window, query.device)
    if not spec.causal:
        mask = torch.ones_like(mask)
    if batched:
        return attend(q[None], k[None], v[None], mask, spec)[0].transpose(0, 1)
    return attend(q, k, v, mask, spec).transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

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
        store_kv_torch(key, value, kv_cache, metadata.slot_mapping, spec.k_scale, spec.v_scale)
        if metadata.is_decode:
            return self._decode(spec, query, kv_cache, metadata)
        out = torch.zeros_like(query)
        starts = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        if starts is None or seq_lens is None:
            starts = metadata.query_start_loc.tolist()
            seq_lens = metadata.seq_lens.tolist()
        for i, seq_len in enumerate(seq_lens):
            q_start, q_end = starts[i], starts[i + 1]
            if q_end == q_start:
                continue
            chunk = query[q_start:q_end]
            out[q_start:q_end] = attend_chunk(
                spec, chunk, kv_cache, metadata.block_table[i], seq_len
            )
        return out

    def _decode(
        self,
        spec: AttentionSpec,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """One query per sequence: gather every context into one padded batch, one SDPA call."""
        block_size = kv_cache.shape[2]
        num_blocks = -(-metadata.max_seq_len // block_size)
        table = metadata.block_table[:, :num_blocks].long()
        b = table.shape[0]
        pages = as_bytes(kv_cache).flatten(2).index_select(1, table.flatten())  # [2, B·n, ...]
        pages = pages.view(kv_cache.dtype).view(2, b, num_blocks * block_size, *kv_cache.shape[3:])
        pages = pages[:, :, : metadata.max_seq_len]  # [2, B, L, Hkv, D]
        k = dequantize(pages[0], spec.k_scale, query.dtype).transpose(1, 2)  # [B, Hkv, L, D]
        v = dequantize(pages[1], spec.v_scale, query.dtype).transpose(1, 2)
        k_pos = torch.arange(metadata.max_seq_len, device=query.device)
        seq_lens = metadata.seq_lens.unsqueeze(1)
        mask = k_pos < seq_lens
        if spec.sliding_window is not None:
            mask &= k_pos > seq_lens - 1 - spec.sliding_window
        q = query[: metadata.num_seqs].unsqueeze(2)  # [B, Hq, 1, D]; padding rows stay zero
        out = torch.zeros_like(query)
        out[: metadata.num_seqs] = attend(q, k, v, mask[:, None, None, :], spec)[:, :, 0]
        return out
