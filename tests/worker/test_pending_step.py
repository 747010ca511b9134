"""`PendingStep.resolve()` returns data and changes nothing else: the sampled tokens (one per
row, or the emitted ones of a verify step) and logprobs land in the step's `ModelRunnerOutput`,
at the rows that sample, the same object on every call; the runner adds them to its request
state from that output."""

from __future__ import annotations

import pytest
import torch

from inferengine.core.sched_output import ModelRunnerOutput
from inferengine.sample.sampler import SamplerOutput
from inferengine.worker.pending_step import (
    DeferredSampling,
    PendingStep,
    SpecResult,
    accept_greedy,
)


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


def test_greedy_acceptance_stops_at_the_first_mismatch():
    # Argmax rows per request: one per draft and one after; drafts accepted while they match.
    argmax = [1, 2, 3, 9, 8, 7, 4, 4]
    drafts = [[1, 2], [5], [7, 4, 6]]  # all match (+ bonus 3); first misses; two match
    assert accept_greedy(argmax, drafts) == [[1, 2, 3], [9], [7, 4, 4]]
    assert accept_greedy([5, 6], [[], []]) == [[5], [6]]  # no drafts: the argmax alone
    assert accept_greedy([], []) == []


def test_a_verify_step_keeps_the_logprobs_of_rows_without_drafts():
    # Row 0 drafted (2 emitted), row 1 did not and is the sampler's only row: its logprobs.
    result = SamplerOutput(
        sampled=torch.tensor([5]),
        logprob_token_ids=torch.tensor([[5, 2]]),
        logprobs=torch.tensor([[-0.5, -1.0]]),
        sampled_ranks=torch.tensor([1]),
    )
    spec = SpecResult(torch.tensor([[7, 8], [5, -1]]), torch.tensor([2, 1]), plain_rows=[1])
    out = PendingStep(_output(["a", "b"]), [0, 1], [1, 1], result, spec).resolve()
    assert out.sampled_token_ids == [[7, 8], [5]]
    assert out.logprobs == {"b": ([[5, 2]], [[-0.5, -1.0]], [1])}


def test_deferred_sampling_waits_for_the_grammar_masks():
    calls = []

    def sample(req_ids, bitmask):
        calls.append((req_ids, bitmask))
        return PendingStep(_output(["a"]), [0], [None], SamplerOutput(torch.tensor([3])))

    deferred = DeferredSampling(sample, graph_size=8)
    assert deferred.graph_size == 8 and calls == []
    with pytest.raises(AssertionError, match="never provided"):
        deferred.resolve()
    deferred.provide_grammar(["a"], b"\x01\x00\x00\x00")
    assert calls == [(["a"], b"\x01\x00\x00\x00")]
    assert deferred.resolve().sampled_token_ids == [[3]]


def test_a_plain_step_takes_no_grammar_masks():
    step = PendingStep(_output(["a"]), [], [], None)
    step.provide_grammar([], b"")  # nothing to mask: fine
    with pytest.raises(AssertionError, match="samples nothing"):
        step.provide_grammar(["a"], b"\x00" * 4)
