"""Persistent input buffers: per-request rows of token ids and block ids, and the staging
buffers one step's inputs are built in (numpy views of pinned memory, copied to the device
asynchronously). Nothing here is allocated per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class StepLayout:
    """One step's batch, in batch order (numpy, host)."""

    rows: np.ndarray  # int64 [B]: each request's persistent row
    starts: np.ndarray  # int64 [B]: num_computed_tokens before the step
    num_scheduled: np.ndarray  # int64 [B]

    @property
    def num_seqs(self) -> int:
        return len(self.rows)


class InputBuffers:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_tokens: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ):
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.max_num_seqs = max_num_seqs
        # Per-request rows, kept across steps (host).
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks), dtype=np.int32)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        # Staging (pinned when a GPU is there) and the device copies they feed.
        pin = device.type == "cuda"
        n, b = max_num_tokens, max_num_seqs

        def pair(shape, dtype):
            host = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids_h, self.input_ids_np, self.input_ids = pair(n, torch.int64)
        self.positions_h, self.positions_np, self.positions = pair(n, torch.int64)
        self.slots_h, self.slots_np, self.slot_mapping = pair(n, torch.int64)
        self.qsl_h, self.qsl_np, self.query_start_loc = pair(b + 1, torch.int32)
        self.seq_lens_h, self.seq_lens_np, self.seq_lens = pair(b, torch.int32)
        self.logits_idx_h, self.logits_idx_np, self.logits_indices = pair(b, torch.int64)
        self.table_h, self.table_np, self.block_table_dev = pair((b, self.max_blocks), torch.int32)

    # ---- rows --------------------------------------------------------------------------

    def add_row(self, token_ids: list[int], block_ids: list[int]) -> int:
        row = self.free_rows.pop()
        self.token_ids[row, : len(token_ids)] = token_ids
        self.block_table[row, : len(block_ids)] = block_ids
        return row

    def free_row(self, row: int) -> None:
        self.free_rows.append(row)

    # ---- one step ----------------------------------------------------------------------

    def stage(self, layout: StepLayout, pad_tokens: int = 0, pad_seqs: int = 0) -> int:
        """Fill the staging buffers for `layout` and copy them to the device.

        With padding (CUDA graphs), `pad_seqs` sequences of one dummy token each follow: they
        read the null block and write nowhere (slot −1). Returns the number of tokens staged.
        """
        bs = self.block_size
        b = layout.num_seqs
        n_sched = layout.num_scheduled
        num_tokens = int(n_sched.sum())
        cu = np.cumsum(n_sched)
        seq_of_token = np.repeat(np.arange(b), n_sched)
        offsets = np.arange(num_tokens) - np.repeat(cu - n_sched, n_sched)
        positions = layout.starts[seq_of_token] + offsets
        rows = layout.rows[seq_of_token]
        self.positions_np[:num_tokens] = positions
        self.input_ids_np[:num_tokens] = self.token_ids[rows, positions]
        block_ids = self.block_table[rows, positions // bs]
        self.slots_np[:num_tokens] = block_ids.astype(np.int64) * bs + positions % bs
        self.qsl_np[0] = 0
        self.qsl_np[1 : b + 1] = cu
        self.seq_lens_np[:b] = layout.starts + n_sched
        self.table_np[:b] = self.block_table[layout.rows]
        total_tokens, total_seqs = num_tokens, b
        if pad_seqs:
            self.input_ids_np[num_tokens : num_tokens + pad_tokens] = 0
            self.positions_np[num_tokens : num_tokens + pad_tokens] = 0
            self.slots_np[num_tokens : num_tokens + pad_tokens] = -1
            self.qsl_np[b + 1 : b + 1 + pad_seqs] = cu[-1] + np.arange(1, pad_seqs + 1)
            self.seq_lens_np[b : b + pad_seqs] = 1
            self.table_np[b : b + pad_seqs] = 0
            total_tokens += pad_tokens
            total_seqs += pad_seqs
        self._copy(total_tokens, total_seqs)
        return total_tokens

    def _copy(self, num_tokens: int, num_seqs: int) -> None:
        kw = {"non_blocking": True}
        self.input_ids[:num_tokens].copy_(self.input_ids_h[:num_tokens], **kw)
        self.positions[:num_tokens].copy_(self.positions_h[:num_tokens], **kw)
        self.slot_mapping[:num_tokens].copy_(self.slots_h[:num_tokens], **kw)
        self.query_start_loc[: num_seqs + 1].copy_(self.qsl_h[: num_seqs + 1], **kw)
        self.seq_lens[:num_seqs].copy_(self.seq_lens_h[:num_seqs], **kw)
        self.block_table_dev[:num_seqs].copy_(self.table_h[:num_seqs], **kw)

    def stage_logits_indices(self, indices: list[int]) -> torch.Tensor:
        n = len(indices)
        self.logits_idx_np[:n] = indices
        self.logits_indices[:n].copy_(self.logits_idx_h[:n], non_blocking=True)
        return self.logits_indices[:n]
