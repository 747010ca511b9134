"""ModelRunner over a fake model on the CPU: the exact inputs each step hands the model (token ids,
positions, slots, query starts, lengths, block table) as requests join, chunk their prompts,
decode, grow blocks, leave and resume after preemption; the tokens it returns; tokens sampled
on the device reaching the next step before the host sees them; drafts verified; prompt
logprobs; and the sampling metadata it builds for the sampler."""

from __future__ import annotations

import math

import pytest
import torch

from inferengine.sampling_params import SamplingParams
from tests.worker.runner_helpers import (
    VOCAB,
    cached,
    make_runner,
    new,
    step,
)


def test_prefill_chunks_decode_new_blocks_and_a_row_reused():
    runner, model = make_runner()
    a_prompt = [1, 2, 3, 4, 5, 6, 11, 12, 13, 14]
    # a: a 10-token prompt over blocks 1 and 2, 4 tokens now; b: a 3-token prompt in full.
    out = runner.execute_model(
        step({"a": 4, "b": 3}, [new("a", a_prompt, [1, 2]), new("b", [7, 8, 9], [3])])
    )
    assert model.calls[-1] == dict(
        ids=[1, 2, 3, 4, 7, 8, 9],
        positions=[0, 1, 2, 3, 0, 1, 2],
        slots=[8, 9, 10, 11, 24, 25, 26],
        qsl=[0, 4, 7],
        seq_lens=[4, 3],
        table=[[1], [3]],  # as many block columns as the longest sequence needs
        num_actual_tokens=7,
        max_query_len=4,
        max_seq_len=4,
    )
    assert out.req_ids == ["a", "b"]
    assert out.sampled_token_ids == [[], [10]]  # a is mid-prompt: nothing sampled

    # a finishes its prompt, crossing into block 2; b decodes its token 10 at position 3.
    out = runner.execute_model(step({"a": 6, "b": 1}, cached_reqs=[cached("a", 4), cached("b", 3)]))
    call = model.calls[-1]
    assert call["ids"] == [5, 6, 11, 12, 13, 14, 10]
    assert call["positions"] == [4, 5, 6, 7, 8, 9, 3]
    assert call["slots"] == [12, 13, 14, 15, 16, 17, 27]
    assert call["qsl"] == [0, 6, 7] and call["seq_lens"] == [10, 4]
    assert call["table"] == [[1, 2], [3, 0]]
    assert call["max_query_len"] == 6 and call["max_seq_len"] == 10
    assert out.sampled_token_ids == [[15], [11]]

    # a leaves; c arrives (in a's row, overwriting it); b decodes 11.
    out = runner.execute_model(
        step({"b": 1, "c": 2}, [new("c", [20, 21], [4])], [cached("b", 4)], finished=["a"])
    )
    call = model.calls[-1]
    assert call["ids"] == [11, 20, 21] and call["positions"] == [4, 0, 1]
    assert call["slots"] == [28, 32, 33]
    assert call["table"] == [[3], [4]]
    assert out.req_ids == ["b", "c"] and out.sampled_token_ids == [[12], [22]]
    assert set(runner.requests) == {"b", "c"}
    assert runner.requests["c"].row == 0  # a's row, handed back when a left
    assert runner.requests["b"].output_token_ids == [10, 11, 12]
    assert runner.requests["b"].num_tokens == 6


def test_a_request_resumed_after_preemption_recomputes_its_outputs():
    runner, model = make_runner()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    runner.execute_model(step({"r": 7}, [new("r", prompt, [3])]))
    # Preempted (dropped), then scheduled again with its two output tokens, in new blocks.
    runner.execute_model(step({}, finished=["r"]))
    assert runner.requests == {}
    out = runner.execute_model(step({"r": 9}, [new("r", prompt, [5, 2], output=[8, 9])]))
    call = model.calls[-1]
    assert call["ids"] == [1, 2, 3, 4, 5, 6, 7, 8, 9] and call["positions"] == list(range(9))
    assert call["slots"] == [40, 41, 42, 43, 44, 45, 46, 47, 16]
    assert call["table"] == [[5, 2]]
    assert out.sampled_token_ids == [[10]]
    assert runner.requests["r"].output_token_ids == [8, 9, 10]


def test_an_empty_step_runs_nothing_but_drops_finished_requests():
    runner, model = make_runner()
    runner.execute_model(step({"r": 3}, [new("r", [7, 8, 9], [3])]))
    out = runner.execute_model(step({}, finished=["r", "never-seen"]))
    assert out.req_ids == [] and out.sampled_token_ids == []
    assert len(model.calls) == 1 and runner.requests == {}
    assert runner.buffers.free_rows[-1] == 0  # its row is next out


def test_async_steps_take_the_previous_token_on_the_device():
    runner, model = make_runner()
    first = runner.execute_model_async(step({"b": 7}, [new("b", [1, 2, 3, 4, 5, 6, 7], [3])]))
    # The next step is launched before the first resolved: the token at position 7 is unknown
    # to the host and is copied from the first step's sampled ids on the device.
    second = runner.execute_model_async(step({"b": 1}, cached_reqs=[cached("b", 7)]))
    assert not first.resolved
    assert model.calls[-1]["ids"] == [8] and model.calls[-1]["positions"] == [7]
    assert model.calls[-1]["slots"] == [31]
    assert first.resolve().sampled_token_ids == [[8]]
    assert second.resolve().sampled_token_ids == [[9]]
    # Position 8 starts the block the scheduler adds now.
    third = runner.execute_model_async(step({"b": 1}, cached_reqs=[cached("b", 8, [6])]))
    assert model.calls[-1]["ids"] == [9] and model.calls[-1]["slots"] == [48]
    assert model.calls[-1]["table"] == [[3, 6]]
    assert third.resolve().sampled_token_ids == [[10]]
    # Resolved tokens reach the request's state (and row) once the runner next reads it.
    runner.execute_model(step({}))
    state = runner.requests["b"]
    assert state.output_token_ids == [8, 9, 10] and state.num_blocks == 2
    assert runner.buffers.token_ids[state.row, :11].tolist() == [*range(1, 11), 0]


def test_drafts_are_scored_and_verified_greedily():
    runner, model = make_runner(num_speculative_tokens=2)
    runner.execute_model(step({"b": 7}, [new("b", [1, 2, 3, 4, 5, 6, 7], [3])]))
    # b verifies drafts [9, 15] after its token 8: the target says 9 (accepted), then 10.
    out = runner.execute_model(
        step({"b": 3}, cached_reqs=[cached("b", 7, [6])], drafts={"b": [9, 15]})
    )
    call = model.calls[-1]
    assert call["ids"] == [8, 9, 15] and call["positions"] == [7, 8, 9]
    assert call["slots"] == [31, 48, 49]
    assert out.sampled_token_ids == [[9, 10]]
    assert runner.requests["b"].output_token_ids == [8, 9, 10]
    # The scheduler rolls back to the accepted tokens: position 9 now holds 10, not draft 15.
    out = runner.execute_model(step({"b": 1}, cached_reqs=[cached("b", 9)]))
    assert model.calls[-1]["ids"] == [10] and model.calls[-1]["slots"] == [49]
    assert out.sampled_token_ids == [[11]]


def test_a_verify_step_mixes_rows_with_and_without_drafts():
    runner, model = make_runner(num_speculative_tokens=3)
    runner.execute_model(step({"a": 2, "b": 3}, [new("a", [1, 2], [1]), new("b", [7, 8, 9], [3])]))
    out = runner.execute_model(
        step(
            {"a": 1, "b": 4},
            cached_reqs=[cached("a", 2), cached("b", 3)],
            drafts={"b": [11, 12, 13]},  # all three right: the bonus token follows
        )
    )
    assert model.calls[-1]["ids"] == [3, 10, 11, 12, 13]
    assert out.sampled_token_ids == [[4], [11, 12, 13, 14]]


def test_prompt_logprobs_over_two_chunks():
    runner, _ = make_runner()
    params = SamplingParams(temperature=0.0, prompt_logprobs=1)
    # The model predicts token + 1: it is right about 2, 3 and wrong about 9 and 5.
    out = runner.execute_model(step({"p": 3}, [new("p", [1, 2, 3, 9, 5], [1, 2], params)]))
    ids, values, ranks, first = out.prompt_logprobs["p"]
    assert first == 0 and ids == [[2, 2], [3, 3], [9, 4]] and ranks == [1, 1, 2]
    top = -math.log1p((VOCAB - 1) * math.exp(-20.0))  # logprob of the +10 logit
    assert values[0] == pytest.approx([top, top], abs=1e-6)
    assert values[2] == pytest.approx([top - 20.0, top], abs=1e-5)
    out = runner.execute_model(step({"p": 2}, cached_reqs=[cached("p", 3)]))
    ids, _, ranks, first = out.prompt_logprobs["p"]
    assert first == 3 and ids == [[5, 10]] and ranks == [2]  # the last position predicts 5
    assert out.sampled_token_ids == [[6]]


def test_sample_logprobs_for_the_rows_that_ask():
    runner, _ = make_runner()
    asks = SamplingParams(temperature=0.0, logprobs=2)
    out = runner.execute_model(
        step({"a": 2, "b": 2}, [new("a", [1, 2], [1], asks), new("b", [4, 5], [2])])
    )
    assert out.sampled_token_ids == [[3], [6]]
    assert set(out.logprobs) == {"a"}
    ids, values, ranks = out.logprobs["a"]
    assert ids[0][:2] == [3, 3] and len(ids[0]) == 3 and ranks == [1]
    assert values[0][2] == pytest.approx(-20.0, abs=1e-4)


def test_sampling_metadata_covers_the_sampling_rows_only():
    runner, _ = make_runner()
    sampled = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=7)
    banned = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9], presence_penalty=0.5)
    runner.execute_model(
        step(
            {"greedy": 2, "chunk": 2, "seeded": 2, "min": 2},
            [
                new("greedy", [1, 2], [1]),
                new("chunk", [1, 2, 3, 4, 5], [2, 3]),  # mid-prompt: no sampling row
                new("seeded", [3, 4], [4], sampled),
                new("min", [5, 6], [5], banned, eos=2),
            ],
        )
    )
    (md,) = runner.sampler.seen
    assert md.temperature.tolist() == pytest.approx([0.0, 0.8, 0.0])
    assert md.top_k.tolist() == [0, 5, 0] and md.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert md.min_p is None
    assert not md.all_greedy and not md.all_random
    assert list(md.generators) == [1]  # the seeded row
    assert md.banned_token_ids == {2: [2, 9]}  # eos and stop ids until min_tokens outputs
    assert md.presence_penalty.tolist() == [0.0, 0.0, 0.5]
    assert runner.sampler.outputs_seen == [[[], [], []]]
    assert md.prompt_token_ids == [[1, 2], [3, 4], [5, 6]]
    assert md.max_num_logprobs is None


def test_penalised_rows_see_every_earlier_token():
    runner, _ = make_runner()
    params = SamplingParams(temperature=0.0, frequency_penalty=0.1)
    runner.execute_model_async(step({"r": 2}, [new("r", [1, 2], [1], params)]))
    runner.execute_model_async(step({"r": 1}, cached_reqs=[cached("r", 2)])).resolve()
    # The second step waited for the first one's token before sampling.
    assert runner.sampler.outputs_seen == [[[]], [[3]]]


def test_a_resumed_seeded_request_skips_the_draws_of_its_earlier_tokens():
    runner, _ = make_runner()
    params = SamplingParams(temperature=1.0, seed=1234)
    runner.execute_model(step({"r": 5}, [new("r", [7, 8, 9], [3, 4], params, output=[1, 2])]))
    (md,) = runner.sampler.seen
    expected = torch.Generator().manual_seed(1234)
    for _ in range(3):  # two skipped draws and the one this step made
        torch.empty(VOCAB).exponential_(generator=expected)
    assert torch.equal(md.generators[0].get_state(), expected.get_state())


def test_graph_shapes_pad_the_step_on_the_cpu():
    runner, model = make_runner(max_num_seqs=8)
    runner.capture_cuda_graphs([1, 2, 4, 8], [16, 32], capture=False)
    runner.execute_model(
        step(
            {"a": 2, "b": 2, "c": 2},
            [new("a", [1, 2], [1]), new("b", [4, 5], [2]), new("c", [7, 8], [3])],
        )
    )
    call = model.calls[-1]  # 6 tokens of 3 sequences: the mixed shape of 16 tokens, 8 seqs
    assert call["ids"] == [1, 2, 4, 5, 7, 8] + [0] * 10
    assert call["slots"] == [8, 9, 16, 17, 24, 25] + [-1] * 10
    assert call["qsl"] == [0, 2, 4, 6, 6, 6, 6, 6, 6]
    assert call["seq_lens"] == [2, 2, 2, 0, 0, 0, 0, 0]
    assert call["max_query_len"] == 16 and call["max_seq_len"] == 32
    out = runner.execute_model(
        step({"a": 1, "b": 1, "c": 1}, cached_reqs=[cached(r, 2) for r in "abc"])
    )
    call = model.calls[-1]  # three decodes: the decode shape of 4
    assert call["ids"] == [3, 6, 9, 0] and call["positions"] == [2, 2, 2, 0]
    assert call["slots"] == [10, 18, 26, -1]
    assert call["qsl"] == [0, 1, 2, 3, 3] and call["seq_lens"] == [3, 3, 3, 0]
    assert call["num_actual_tokens"] == 4 and call["max_query_len"] == 1
    assert out.sampled_token_ids == [[4], [7], [10]]  # padding rows sample nothing
