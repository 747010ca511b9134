"""CUDA-graph shapes, on the CPU (nothing captured): the default capture sizes, the smallest
shape that holds a step (decode, verify, mixed, or none), the metadata each shape reuses, and
an eager replay over the padded persistent buffers."""

from __future__ import annotations

import numpy as np
import torch

from inferengine.worker.cuda_graphs import (
    MAX_MIXED_GRAPH_TOKENS,
    CudaGraphRunner,
    GraphShape,
    default_capture_sizes,
    default_mixed_sizes,
)
from inferengine.worker.input_batch import InputBuffers, StepLayout


def test_default_decode_sizes():
    assert default_capture_sizes(256, 8192) == [1, 2, 4, 8, *range(16, 257, 8)]
    assert default_capture_sizes(20, 8192) == [1, 2, 4, 8, 16, 20]  # the limit itself ends it
    assert default_capture_sizes(64, 6) == [1, 2, 4, 6]  # no batch beyond the token budget
    assert default_capture_sizes(3, 100) == [1, 2, 3]
    assert default_capture_sizes(1, 100) == [1]


def test_default_mixed_sizes():
    full = default_mixed_sizes(8192)
    assert full == [64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
                    1280, 1536, 1792, 2048]  # fmt: skip
    assert full[-1] == MAX_MIXED_GRAPH_TOKENS
    assert default_mixed_sizes(300) == [64, 128, 192, 256]
    assert default_mixed_sizes(63) == []


def test_graph_shape_keys():
    assert GraphShape("decode", 8, 8, 1).key == ("decode", 8)
    assert GraphShape("mixed", 64, 16, 64).key == ("mixed", 64)
    assert GraphShape("verify", 12, 4, 3).key == ("verify", 4)  # verify shapes: by batch


def _graphs(verify_len: int = 3, forward=None) -> CudaGraphRunner:
    buffers = InputBuffers(16, 128, 64, 16, torch.device("cpu"))
    return CudaGraphRunner(
        buffers, 64, forward, [1, 2, 4, 8], [64, 128], capture=False, verify_len=verify_len
    )


def _shape(g: CudaGraphRunner, *step) -> tuple | None:
    s = g.shape_for(*step)
    return None if s is None else (s.kind, s.num_tokens, s.num_seqs, s.max_query_len)


def test_the_smallest_shape_that_holds_the_step():
    g = _graphs()
    assert g.verify_sizes == [1, 2, 4, 8]
    assert _shape(g, 3, 3, 1) == ("decode", 4, 4, 1)
    assert _shape(g, 8, 8, 1) == ("decode", 8, 8, 1)
    # Too many decodes for a decode or verify graph: the mixed shape, its seqs capped at 16.
    assert _shape(g, 9, 9, 1) == ("mixed", 64, 16, 64)
    assert _shape(g, 7, 3, 3) == ("verify", 12, 4, 3)  # 4 sequences of up to 1 + 2 drafts
    assert _shape(g, 70, 2, 40) == ("mixed", 128, 16, 128)
    assert _shape(g, 200, 2, 150) is None  # beyond the largest mixed graph: eager
    assert _shape(g, 40, 20, 2) is None  # more sequences than the shape has slots


def test_without_drafts_there_are_no_verify_shapes():
    g = _graphs(verify_len=1)
    assert g.verify_sizes == []
    assert _shape(g, 6, 3, 2) == ("mixed", 64, 16, 64)


def test_verify_sizes_stop_at_the_token_budget():
    buffers = InputBuffers(16, 20, 64, 16, torch.device("cpu"))
    g = CudaGraphRunner(buffers, 64, None, [1, 2, 4, 8], [], capture=False, verify_len=5)
    assert g.verify_sizes == [1, 2, 4]  # 8 x 5 tokens would not fit 20


def test_each_shape_reuses_one_metadata_over_the_persistent_buffers():
    g = _graphs()
    shape = g.shape_for(3, 3, 1)
    md = g.metadata(shape)
    assert g.metadata(g.shape_for(4, 4, 1)) is md  # the same decode-4 graph
    assert md.num_actual_tokens == 4 and md.max_query_len == 1 and md.max_seq_len == 64
    b = g.buffers
    assert md.query_start_loc.data_ptr() == b.query_start_loc.data_ptr()
    assert md.query_start_loc.shape == (5,) and md.seq_lens.shape == (4,)
    assert md.block_table.shape == (4, 4) and md.slot_mapping.shape == (4,)
    assert md.query_start_loc_cpu is None  # graphs read no host-side lengths
    assert g.metadata(g.shape_for(7, 3, 3)) is not md


def test_an_eager_replay_runs_the_forward_over_the_padded_buffers():
    seen = []

    def forward(ids, positions, md):
        seen.append((ids.tolist(), positions.tolist(), md.slot_mapping.tolist(), dict(md.per_step)))
        md.per_step["mask"] = "built once per step"
        return ids.float()

    g = _graphs(forward=forward)
    b = g.buffers
    for tokens, blocks in (([5, 6, 7], [2]), ([8, 9], [3]), ([4], [1])):
        b.add_row(tokens, blocks)
    layout = StepLayout(np.array([0, 1, 2]), np.array([2, 1, 0]), np.array([1, 1, 1]))
    shape = g.shape_for(3, 3, 1)  # decode 4: one padding token and sequence
    b.stage(layout, pad_tokens=shape.num_tokens - 3, pad_seqs=shape.num_seqs - 3)
    assert g.replay(shape).tolist() == [7.0, 9.0, 4.0, 0.0]
    g.replay(shape)
    # Positions 2, 1 and 0 in blocks 2, 3 and 1 (16 tokens a page), the padding token writing
    # nowhere; what a backend cached in per_step for one step is gone at the next.
    call = ([7, 9, 4, 0], [2, 1, 0, 0], [34, 49, 16, -1], {})
    assert seen == [call, call]
