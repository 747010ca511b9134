"""`PendingStep.resolve()` returns data and changes nothing else: the sampled tokens (one per
row, or the emitted ones of a verify step) and logprobs land in the step's `ModelRunnerOutput`,
at the rows that sample, the same object on every call; the runner adds them to its request
state from that output."""

from __future__ import annotations

import torch

from inferengine.core.sched_output import ModelRunnerOutput
from inferengine.sample.sampler import SamplerOutput
from inferengine.worker.pending_step import PendingStep, SpecResult


def _output(req_ids):
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])


def test_a_plain_step_returns_one_token_per_sampling_row_and_the_logprobs_asked_for():
    result = SamplerOutput(
        sampled=torch.tensor([11, 12]),
        logprob_token_ids=torch.tensor([[11, 3, 4], [12, 5, 6]]),
        logprobs=torch.tensor([[-0.5, -1.0, -2.0], [-0.25, -1.5, -3.0]]),
        sampled_ranks=torch.tensor([1, 2]),
    )
    # "b" is a prompt chunk that samples nothing; "c" asks for one top logprob.
    step = PendingStep(_output(["a", "b", "c"]), [0, 2], [None, 1], result)
    assert not step.resolved
    out = step.resolve()
    assert step.resolved and step.resolve() is out
    assert out.sampled_token_ids == [[11], [], [12]]
    assert out.logprobs == {"c": ([[12, 5]], [[-0.25, -1.5]], [2])}
    assert step.sampled_device is result.sampled  # the next step may read it on the device


def test_a_verify_step_returns_the_emitted_tokens_of_each_row():
    # Row 0 verified two drafts and emits 3 tokens; row 1 had none (the sampler's row 0).
    spec = SpecResult(
        tokens=torch.tensor([[7, 8, 9], [5, -1, -1]]),
        num_emitted=torch.tensor([3, 1]),
        plain_rows=[1],
    )
    step = PendingStep(
        _output(["a", "b"]), [0, 1], [None, None], SamplerOutput(torch.tensor([5])), spec
    )
    assert step.sampled_device is None  # several tokens a row: no device hand-off
    assert step.resolve().sampled_token_ids == [[7, 8, 9], [5]]


def test_a_greedy_verify_step_accepts_drafts_on_the_host():
    # Argmax at each logits row: "a" drafted [4, 6] (the first matches), "b" drafted nothing.
    spec = SpecResult(torch.tensor([4, 5, 1, 9]), None, [], greedy_drafts=[[4, 6], []])
    step = PendingStep(_output(["a", "b"]), [0, 1], [None, None], None, spec)
    assert step.resolve().sampled_token_ids == [[4, 5], [9]]


def test_a_step_that_samples_nothing_resolves_to_empty_rows():
    step = PendingStep(_output(["a"]), [], [], None)
    assert step.resolve().sampled_token_ids == [[]]
    assert step.sampled_device is None
