"""Structured output on the worker: the engine core's packed token bitmask, applied to the
logits of the rows that sample under a grammar before any sampling (a disallowed token's logit
becomes -inf), on the logits' device and without waiting for the host."""

from __future__ import annotations

import numpy as np
import torch


def apply_grammar_bitmask(
    logits: torch.Tensor,
    req_ids: list[str],
    bitmask: bytes,
    sample_req_ids: list[str],
    num_drafts: list[int],
) -> None:
    """Mask `logits` ([sum(1 + drafts_i), vocab], one block of rows per sampling request of
    `sample_req_ids`) in place at every position (drafts included) of the requests `req_ids`,
    whose packed rows `bitmask` holds in that order."""
    first_row = np.cumsum([0, *(1 + d for d in num_drafts)])[:-1]
    block = {r: (int(first_row[i]), 1 + num_drafts[i]) for i, r in enumerate(sample_req_ids)}
    rows = [row for r in req_ids for row in range(block[r][0], sum(block[r]))]
    num_words = len(bitmask) // 4
    # The words and then the row numbers, in one page-locked buffer: one copy that does not
    # wait for the host (the caching host allocator keeps the buffer until it is done).
    host = torch.empty(num_words + len(rows), dtype=torch.int32, pin_memory=logits.is_cuda)
    staged = host.numpy()
    staged[:num_words] = np.frombuffer(bitmask, dtype=np.int32)
    staged[num_words:] = rows
    device = host.to(logits.device, non_blocking=True)
    packed = device[:num_words].view(len(rows), -1)
    index = device[num_words:].long()
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((packed.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)
