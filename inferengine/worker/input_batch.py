"""Persistent input buffers: per-request rows of token ids and block ids, and the staging
buffers one step's inputs are built in (numpy views of pinned memory, copied to the device
asynchronously), with each request's state beside its row. Nothing here is allocated per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from inferengine.sampling_params import SamplingParams


@dataclass(slots=True)
class RequestState:
    """What the model runner keeps of a request between steps."""

    req_id: str
    row: int  # persistent row in the input buffers (-1 once the request has left)
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_tokens: int  # prompt + output tokens known so far
    sampling_params: SamplingParams
    eos_token_id: int | None
    num_blocks: int
    num_computed_tokens: int
    generator: torch.Generator | None


def append_tokens(token_buffer: np.ndarray, state: RequestState, tokens: list[int]) -> None:
    """Add a request's new tokens to its state and its row of the token buffer (tokens past
    the buffer's width, which no step reads, are counted but not stored)."""
    state.output_token_ids.extend(tokens)
    width = token_buffer.shape[1]
    start, end = min(state.num_tokens, width), min(state.num_tokens + len(tokens), width)
    token_buffer[state.row, start:end] = tokens[: end - start]
    state.num_tokens += len(tokens)


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
        max_logits_rows: int | None = None,  # sampling positions per step (drafts add some)
    ):
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max_num_tokens
        # Per-request rows, kept across steps (host).
        self.token_ids = np.zeros((max_num_seqs, max_model_len + 1), dtype=np.int64)
        self.block_table = np.zeros((max_num_seqs, self.max_blocks), dtype=np.int32)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        # Two sets of staging buffers (pinned when a GPU is there), used in turn: with async
        # scheduling a step is staged while the previous step's copies may still be queued.
        pin = device.type == "cuda"
        n, b = max_num_tokens, max_num_seqs
        rows = max_logits_rows or b
        self._staging = [_Staging(n, b, self.max_blocks, rows, pin) for _ in range(2)]
        self._turn = 0
        self.st = self._staging[0]

        def dev(shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = dev(n, torch.int64)
        self.positions = dev(n, torch.int64)
        self.slot_mapping = dev(n, torch.int64)
        self.query_start_loc = dev(b + 1, torch.int32)
        self.seq_lens = dev(b, torch.int32)
        self.logits_indices = dev(rows, torch.int64)
        self.block_table_dev = dev((b, self.max_blocks), torch.int32)
        self.fill_dst = dev(b, torch.int64)
        self.fill_src = dev(b, torch.int64)

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
        """Fill a staging set for `layout` and copy it to the device.

        With padding (CUDA graphs), `pad_tokens` trailing tokens belong to no sequence and write
        nowhere (slot −1), and `pad_seqs` trailing sequences have no queries and no context.
        Returns the number of tokens staged.
        """
        self._turn ^= 1
        st = self.st = self._staging[self._turn]
        bs = self.block_size
        b = layout.num_seqs
        n_sched = layout.num_scheduled
        num_tokens = int(n_sched.sum())
        cu = np.cumsum(n_sched)
        seq_of_token = np.repeat(np.arange(b), n_sched)
        offsets = np.arange(num_tokens) - np.repeat(cu - n_sched, n_sched)
        positions = layout.starts[seq_of_token] + offsets
        rows = layout.rows[seq_of_token]
        st.positions[:num_tokens] = positions
        st.input_ids[:num_tokens] = self.token_ids[rows, positions]
        block_ids = self.block_table[rows, positions // bs]
        st.slots[:num_tokens] = block_ids.astype(np.int64) * bs + positions % bs
        st.qsl[0] = 0
        st.qsl[1 : b + 1] = cu
        st.seq_lens[:b] = layout.starts + n_sched
        st.table[:b] = self.block_table[layout.rows]
        total_tokens, total_seqs = num_tokens, b
        if pad_tokens:
            st.input_ids[num_tokens : num_tokens + pad_tokens] = 0
            st.positions[num_tokens : num_tokens + pad_tokens] = 0
            st.slots[num_tokens : num_tokens + pad_tokens] = -1
            total_tokens += pad_tokens
        if pad_seqs:
            st.qsl[b + 1 : b + 1 + pad_seqs] = num_tokens
            st.seq_lens[b : b + pad_seqs] = 0
            st.table[b : b + pad_seqs] = 0
            total_seqs += pad_seqs
        st.copy_to(self, total_tokens, total_seqs)
        return total_tokens

    def stage_logits_indices(self, indices: list[int]) -> torch.Tensor:
        n = len(indices)
        self.st.logits_idx[:n] = indices
        self.logits_indices[:n].copy_(self.st.logits_idx_t[:n], non_blocking=True)
        return self.logits_indices[:n]

    def fill_from_device(self, dst: list[int], src: list[int], values: torch.Tensor) -> None:
        """input_ids[dst[i]] = values[src[i]] on the device: tokens sampled by the previous
        step that the host has not seen yet (async scheduling)."""
        n = len(dst)
        self.st.fill_dst[:n] = dst
        self.st.fill_src[:n] = src
        self.fill_dst[:n].copy_(self.st.fill_dst_t[:n], non_blocking=True)
        self.fill_src[:n].copy_(self.st.fill_src_t[:n], non_blocking=True)
        self.input_ids.index_copy_(0, self.fill_dst[:n], values.index_select(0, self.fill_src[:n]))


class _Staging:
    """One set of host staging buffers: pinned tensors and numpy views of them."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, max_rows: int, pin: bool):
        def host(shape, dtype):
            t = torch.zeros(shape, dtype=dtype, pin_memory=pin)
            return t, t.numpy()

        self.input_ids_t, self.input_ids = host(max_tokens, torch.int64)
        self.positions_t, self.positions = host(max_tokens, torch.int64)
        self.slots_t, self.slots = host(max_tokens, torch.int64)
        self.qsl_t, self.qsl = host(max_seqs + 1, torch.int32)
        self.seq_lens_t, self.seq_lens = host(max_seqs, torch.int32)
        self.table_t, self.table = host((max_seqs, max_blocks), torch.int32)
        self.logits_idx_t, self.logits_idx = host(max_rows, torch.int64)
        self.fill_dst_t, self.fill_dst = host(max_seqs, torch.int64)
        self.fill_src_t, self.fill_src = host(max_seqs, torch.int64)

    def copy_to(self, buffers: InputBuffers, num_tokens: int, num_seqs: int) -> None:
        kw = {"non_blocking": True}
        buffers.input_ids[:num_tokens].copy_(self.input_ids_t[:num_tokens], **kw)
        buffers.positions[:num_tokens].copy_(self.positions_t[:num_tokens], **kw)
        buffers.slot_mapping[:num_tokens].copy_(self.slots_t[:num_tokens], **kw)
        buffers.query_start_loc[: num_seqs + 1].copy_(self.qsl_t[: num_seqs + 1], **kw)
        buffers.seq_lens[:num_seqs].copy_(self.seq_lens_t[:num_seqs], **kw)
        buffers.block_table_dev[:num_seqs].copy_(self.table_t[:num_seqs], **kw)
