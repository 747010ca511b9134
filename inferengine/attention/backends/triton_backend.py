"""The Triton attention backend: KV store and paged attention kernels, CUDA-graph safe.

Nothing here reads a device value on the host, so a decode step can be captured in a graph:
launch shapes depend only on tensor shapes and the bounds in `AttentionMetadata`.
"""

from __future__ import annotations

import torch

from inferengine.attention.backends.base import AttentionBackend, AttentionSpec, RotaryInputs
from inferengine.attention.metadata import AttentionMetadata
from inferengine.kernels.kv_store import rotary_store_kv, store_kv
from inferengine.kernels.paged_attention import paged_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cuda_graph_safe = True
    fuses_rotary = True

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
        scales = dict(k_scale=spec.k_scale, v_scale=spec.v_scale)
        if rotary is not None:
            rotary_store_kv(
                rotary.positions, query, key, value, kv_cache, metadata.slot_mapping,
                rotary.cos_sin_cache, **scales,
            )  # fmt: skip
        else:
            store_kv(key, value, kv_cache, metadata.slot_mapping, **scales)
        return paged_attention(
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            max_query_len=metadata.max_query_len,
            min_query_len=metadata.min_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=spec.scale,
            sliding_window=spec.sliding_window,
            soft_cap=spec.logits_soft_cap,
            fresh_key=key,
            fresh_value=value,
            **scales,
        )
