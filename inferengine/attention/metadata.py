"""`AttentionMetadata`: how the flattened tokens of one step map onto sequences and KV pages."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Batch layout for one forward pass, built by the model runner and passed as an argument.

    Sequence i owns query tokens `query_start_loc[i] : query_start_loc[i+1]`, which are the last
    positions of its `seq_lens[i]` tokens of context. Token t's K/V go to flat slot
    `slot_mapping[t]` (block id · block_size + offset; −1 for padding, never written).
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [B + 1], on the device
    seq_lens: torch.Tensor  # int32 [B], on the device
    block_table: torch.Tensor  # int32 [B, max_blocks], on the device
    slot_mapping: torch.Tensor  # int64 [num_tokens], on the device
    # A lower bound on every sequence's query length (0: unknown); prefill-only steps skip the
    # decode launch with it.
    min_query_len: int = 0
    # Host copies for backends that loop in Python (the torch reference); None in CUDA graphs.
    query_start_loc_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # What a backend derives once per step and reuses in every layer (e.g. flex's block mask).
    per_step: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence has exactly one query token, and no token is padding."""
        return self.max_query_len == 1 and self.num_actual_tokens == self.num_seqs
