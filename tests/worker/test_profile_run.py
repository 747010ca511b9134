"""The memory-profiling step, run on the CPU over a fake model: the largest step the scheduler
can send, split into max_model_len sequences on throwaway pages, then logits and sampling
(with top-k, top-p and logprobs) for as many rows as a step samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from inferengine.worker.profile_run import profile_run
from tests.worker.runner_helpers import VOCAB, FakeModel, RecordingSampler, engine_config


class KVRecordingModel(FakeModel):
    def __init__(self):
        super().__init__()
        self.kv_shapes: list[list[tuple[int, ...]]] = []
        self.logits_rows: list[int] = []

    def forward(self, input_ids, positions, kv_caches, metadata, intermediate=None):
        self.kv_shapes.append([tuple(t.shape) for t in kv_caches])
        self.calls_cpu = (metadata.query_start_loc_cpu, metadata.seq_lens_cpu)
        return super().forward(input_ids, positions, kv_caches, metadata)

    def compute_logits(self, hidden):
        self.logits_rows.append(len(hidden))
        return super().compute_logits(hidden)


def fake_runner(**kwargs):
    config = engine_config(**kwargs)
    return SimpleNamespace(
        config=config,
        block_size=config.cache_config.block_size,
        device=torch.device("cpu"),
        vocab_size=VOCAB,
        hidden_size=8,
        model=KVRecordingModel(),
        sampler=RecordingSampler(),
    )


def test_the_largest_step_in_max_model_len_sequences():
    runner = fake_runner(max_num_seqs=8, max_num_batched_tokens=40, max_model_len=16)
    profile_run(runner)
    model = runner.model
    (call,) = model.calls
    # 40 tokens: sequences of 16, 16 and 8, each on its own pages after the null page.
    assert call["qsl"] == [0, 16, 32, 40] and call["seq_lens"] == [16, 16, 8]
    assert model.calls_cpu == ([0, 16, 32, 40], [16, 16, 8])
    assert call["table"] == [[1, 2], [3, 4], [5, 6]]
    assert call["slots"] == list(range(8, 48))
    assert call["positions"] == [*range(16), *range(16), *range(8)]
    assert call["num_actual_tokens"] == 40
    assert call["max_query_len"] == 16 and call["max_seq_len"] == 16
    assert all(0 <= t < VOCAB for t in call["ids"])
    # One layer of 7 pages (6 and the null page): [K/V, pages, block, kv heads, head dim].
    assert model.kv_shapes == [[(2, 7, 8, 1, 4)]]
    # A sampling row per sequence the scheduler may run, with every sampling feature on.
    assert model.logits_rows == [8]
    (md,) = runner.sampler.seen
    assert md.top_k.tolist() == [50] * 8
    assert md.top_p.tolist() == pytest.approx([0.9] * 8)
    assert md.max_num_logprobs == 5 and md.all_random


def test_a_budget_below_max_model_len_is_one_sequence():
    runner = fake_runner(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=32)
    profile_run(runner)
    (call,) = runner.model.calls
    assert call["qsl"] == [0, 12] and call["table"] == [[1, 2]]
    assert call["slots"] == list(range(8, 20))
    assert runner.model.kv_shapes == [[(2, 3, 8, 1, 4)]]
    assert runner.model.logits_rows == [4]


def test_drafts_add_sampling_rows_up_to_the_token_budget():
    runner = fake_runner(
        max_num_seqs=8, max_num_batched_tokens=40, max_model_len=16, num_speculative_tokens=2
    )
    profile_run(runner)
    assert runner.model.logits_rows == [24]  # 8 requests and 2 drafts each
    runner = fake_runner(
        max_num_seqs=8, max_num_batched_tokens=20, max_model_len=16, num_speculative_tokens=4
    )
    profile_run(runner)
    assert runner.model.logits_rows == [20]  # 40 rows, but the step has 20 tokens
