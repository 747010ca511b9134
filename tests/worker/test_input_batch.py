"""InputBuffers: persistent rows (token ids, block ids) handed out and taken back, and the exact
inputs a step stages from them (token ids, positions, slot mapping, query starts, sequence
lengths, block table), with and without CUDA-graph padding; append_tokens past the row's end."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferengine.sampling_params import SamplingParams
from inferengine.worker.input_batch import InputBuffers, RequestState, StepLayout, append_tokens

BS = 4
CPU = torch.device("cpu")


def buffers(max_num_seqs: int = 4, max_num_tokens: int = 16, max_model_len: int = 20):
    return InputBuffers(max_num_seqs, max_num_tokens, max_model_len, BS, CPU)


def layout(rows, starts, num_scheduled) -> StepLayout:
    return StepLayout(
        rows=np.array(rows, dtype=np.int64),
        starts=np.array(starts, dtype=np.int64),
        num_scheduled=np.array(num_scheduled, dtype=np.int64),
    )


def state(row: int, tokens: list[int]) -> RequestState:
    return RequestState(
        req_id="r",
        row=row,
        prompt_token_ids=list(tokens),
        output_token_ids=[],
        num_tokens=len(tokens),
        sampling_params=SamplingParams(),
        eos_token_id=None,
        num_blocks=0,
        num_computed_tokens=0,
        generator=None,
    )


def test_shapes_follow_the_limits():
    b = buffers(max_num_seqs=3, max_num_tokens=10, max_model_len=17)
    assert b.max_blocks == 5  # ceil(17 / 4)
    assert b.token_ids.shape == (3, 18)  # one column past max_model_len
    assert b.block_table.shape == (3, 5) and b.block_table.dtype == np.int32
    assert b.input_ids.shape == (10,) and b.slot_mapping.dtype == torch.int64
    assert b.query_start_loc.shape == (4,) and b.query_start_loc.dtype == torch.int32
    assert b.block_table_dev.shape == (3, 5)
    assert b.logits_indices.shape == (3,)  # one sampling row per sequence by default
    with_drafts = InputBuffers(3, 10, 17, BS, CPU, max_logits_rows=9)
    assert with_drafts.logits_indices.shape == (9,)


def test_rows_are_handed_out_lowest_first_and_a_freed_row_comes_back_next():
    b = buffers()
    assert [b.add_row([i], [i]) for i in range(3)] == [0, 1, 2]
    b.free_row(1)
    assert b.add_row([7], [7]) == 1  # the freed row, before the never-used row 3
    assert b.add_row([8], [8]) == 3
    assert b.free_rows == []
    b.free_row(2)
    b.free_row(0)
    assert b.add_row([9], [9]) == 0 and b.add_row([9], [9]) == 2  # last freed, first reused


def test_add_row_writes_the_tokens_and_blocks_and_leaves_other_rows_alone():
    b = buffers()
    r0 = b.add_row([10, 11, 12, 13, 14], [3, 7])
    r1 = b.add_row([20, 21], [5])
    assert b.token_ids[r0, :6].tolist() == [10, 11, 12, 13, 14, 0]
    assert b.block_table[r0].tolist() == [3, 7, 0, 0, 0]
    assert b.token_ids[r1, :3].tolist() == [20, 21, 0]
    assert b.block_table[r1].tolist() == [5, 0, 0, 0, 0]
    # Freeing a row moves nothing: the batch is not condensed, rows stay where they are.
    b.free_row(r0)
    assert b.token_ids[r1, :2].tolist() == [20, 21] and b.block_table[r1, 0] == 5
    r2 = b.add_row([30, 31, 32], [9])
    assert r2 == r0
    assert b.token_ids[r2, :3].tolist() == [30, 31, 32] and b.block_table[r2, 0] == 9


def _three_requests() -> tuple[InputBuffers, StepLayout]:
    b = buffers(max_num_seqs=6)
    b.add_row(list(range(10, 17)), [3, 7])  # row 0: 7 tokens
    b.add_row([20, 21, 22], [5])  # row 1: a fresh prompt
    b.add_row(list(range(30, 39)), [1, 2, 4])  # row 2: 9 tokens
    # Batch order: row 2 (prefill chunk of 3 from position 4), row 0 (a decode at position 6),
    # row 1 (its whole prompt).
    return b, layout([2, 0, 1], [4, 6, 0], [3, 1, 3])


def test_stage_builds_exact_inputs_from_the_rows():
    b, step = _three_requests()
    assert step.num_seqs == 3
    assert b.stage(step) == 7
    st = b.st
    assert st.input_ids[:7].tolist() == [34, 35, 36, 16, 20, 21, 22]
    assert st.positions[:7].tolist() == [4, 5, 6, 6, 0, 1, 2]
    # block id * 4 + offset: row 2's position 4-6 in its 2nd block (2), row 0's position 6 in
    # its 2nd block (7), row 1's positions 0-2 in block 5.
    assert st.slots[:7].tolist() == [8, 9, 10, 30, 20, 21, 22]
    assert st.qsl[:4].tolist() == [0, 3, 4, 7]
    assert st.seq_lens[:3].tolist() == [7, 7, 3]
    assert st.table[:3].tolist() == [[1, 2, 4, 0, 0], [3, 7, 0, 0, 0], [5, 0, 0, 0, 0]]
    # The same values reach the device tensors.
    assert b.input_ids[:7].tolist() == [34, 35, 36, 16, 20, 21, 22]
    assert b.positions[:7].tolist() == [4, 5, 6, 6, 0, 1, 2]
    assert b.slot_mapping[:7].tolist() == [8, 9, 10, 30, 20, 21, 22]
    assert b.query_start_loc[:4].tolist() == [0, 3, 4, 7]
    assert b.seq_lens[:3].tolist() == [7, 7, 3]
    assert b.block_table_dev[:3, :3].tolist() == [[1, 2, 4], [3, 7, 0], [5, 0, 0]]


def test_stage_pads_tokens_that_write_nowhere_and_sequences_with_no_context():
    b, step = _three_requests()
    b.input_ids.fill_(99)
    assert b.stage(step, pad_tokens=3, pad_seqs=2) == 10
    assert b.input_ids[:10].tolist() == [34, 35, 36, 16, 20, 21, 22, 0, 0, 0]
    assert b.positions[7:10].tolist() == [0, 0, 0]
    assert b.slot_mapping[:10].tolist() == [8, 9, 10, 30, 20, 21, 22, -1, -1, -1]
    assert b.query_start_loc[:6].tolist() == [0, 3, 4, 7, 7, 7]  # padded sequences: no queries
    assert b.seq_lens[:5].tolist() == [7, 7, 3, 0, 0]
    assert b.block_table_dev[3:5].tolist() == [[0] * 5, [0] * 5]
    assert b.input_ids[10].item() == 99  # nothing staged past the padded shape


def test_steps_alternate_staging_sets_so_a_queued_copy_keeps_its_source():
    b, step = _three_requests()
    b.stage(step)
    first = b.st
    b.stage(layout([1], [3], [1]))  # row 1's next token
    assert b.st is not first
    assert b.st.input_ids[:1].tolist() == [0] and b.st.slots[:1].tolist() == [23]
    assert first.input_ids[:7].tolist() == [34, 35, 36, 16, 20, 21, 22]  # untouched
    b.stage(step)
    assert b.st is first


def test_logits_indices_and_tokens_filled_from_the_device():
    b, step = _three_requests()
    b.stage(step)
    rows = b.stage_logits_indices([2, 3, 6])
    assert rows.tolist() == [2, 3, 6]
    assert rows.data_ptr() == b.logits_indices.data_ptr()  # a view of the persistent buffer
    # Tokens the previous step sampled (not on the host yet) go into the staged input ids.
    b.fill_from_device([0, 3], [1, 0], torch.tensor([100, 200]))
    assert b.input_ids[:7].tolist() == [200, 35, 36, 100, 20, 21, 22]


def test_append_tokens_extends_the_state_and_the_row():
    b = buffers()
    row = b.add_row([1, 2, 3], [1])
    s = state(row, [1, 2, 3])
    append_tokens(b.token_ids, s, [4, 5])
    assert s.output_token_ids == [4, 5] and s.num_tokens == 5
    assert b.token_ids[row, :6].tolist() == [1, 2, 3, 4, 5, 0]


def test_append_tokens_counts_but_does_not_store_tokens_past_the_row():
    b = buffers(max_model_len=8)  # rows of 9 columns
    row = b.add_row(list(range(1, 8)), [1, 2])
    s = state(row, list(range(1, 8)))
    append_tokens(b.token_ids, s, [50, 51, 52])
    assert s.num_tokens == 10 and s.output_token_ids == [50, 51, 52]
    assert b.token_ids[row].tolist() == [1, 2, 3, 4, 5, 6, 7, 50, 51]
    append_tokens(b.token_ids, s, [53])  # entirely past the end: counted only
    assert s.num_tokens == 11 and s.output_token_ids == [50, 51, 52, 53]
    append_tokens(b.token_ids, s, [54, 55, 56, 57])  # several (a verify step's), past the end
    assert s.num_tokens == 15 and s.output_token_ids == [50, 51, 52, 53, 54, 55, 56, 57]
    assert b.token_ids[row].tolist() == [1, 2, 3, 4, 5, 6, 7, 50, 51]


@pytest.mark.parametrize("block_size", [8, 16])
def test_slots_cross_block_boundaries(block_size):
    b = InputBuffers(2, 64, 64, block_size, CPU)
    tokens = list(range(100, 140))
    blocks = [9, 4, 6, 2, 8][: -(-40 // block_size)]
    row = b.add_row(tokens, blocks)
    assert b.stage(layout([row], [block_size - 2], [4])) == 4
    expected = [blocks[p // block_size] * block_size + p % block_size
                for p in range(block_size - 2, block_size + 2)]  # fmt: skip
    assert b.slot_mapping[:4].tolist() == expected
    assert b.input_ids[:4].tolist() == tokens[block_size - 2 : block_size + 2]
