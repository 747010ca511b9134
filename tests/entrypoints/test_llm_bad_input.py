"""Bad requests raise clear errors and leave the other requests running."""

from __future__ import annotations

import pytest

from inferengine import LLM, SamplingParams
from inferengine.errors import ConfigError, InvalidRequestError


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama3-tied")), max_model_len=128)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens must be at least 1"),
        (lambda: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (lambda: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (lambda: SamplingParams(n=0), "n must be at least 1"),
        (lambda: SamplingParams(temperature=-1), "temperature must be 0 or more"),
    ],
)
def test_bad_sampling_params(make, match):
    with pytest.raises(InvalidRequestError, match=match):
        make()


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(InvalidRequestError, match="more than this model's maximum context"):
        llm.generate({"prompt_token_ids": [5] * 200}, use_tqdm=False)


def test_token_ids_outside_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 100000]}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="stop_token_ids names token id 999999"):
        llm.generate("hello", SamplingParams(stop_token_ids=[999999]), use_tqdm=False)


def test_token_ids_that_are_not_integers(llm):
    # A chat template's BatchEncoding (Transformers 5) iterates as its keys, which are strings.
    for ids in (["input_ids", "attention_mask"], [5, 6.0], [5, True]):
        with pytest.raises(InvalidRequestError, match="prompt token ids must be integers"):
            llm.generate({"prompt_token_ids": ids}, use_tqdm=False)


def test_priority_without_priority_scheduling_is_refused(llm):
    """Under fcfs the scheduler never reads a priority: refused (as vLLM does), not ignored."""
    with pytest.raises(InvalidRequestError, match="priority 3 needs priority scheduling") as info:
        llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=False, priority=[0, 3])
    assert info.value.param == "priority"
    assert "--scheduling-policy priority" in info.value.message
    assert not llm.llm_engine.has_unfinished_requests()  # refused before any request started


def test_max_waiting_requests_is_refused_offline(tiny_checkpoint):
    """It bounds the server's queue (503s); offline nothing would use it."""
    with pytest.raises(ConfigError, match="--max-waiting-requests applies to `inferengine serve`"):
        LLM(str(tiny_checkpoint("llama3-tied")), max_waiting_requests=4)


def test_bad_request_leaves_running_requests_alone(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("good-1", {"prompt_token_ids": [3, 4, 5]}, params)
    engine.add_request("good-2", {"prompt_token_ids": [7] * 40}, params)
    engine.step()
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", {"prompt_token_ids": [1] * 500}, params)
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", {"prompt_token_ids": [-3]}, params)
    finished = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {"good-1", "good-2"}
    assert all(len(o.outputs[0].token_ids) == 12 for o in finished.values())


def test_engine_core_refuses_bad_ids_without_crashing(llm):
    """A request that skipped input validation is failed by the core, not the engine."""
    from inferengine.core.engine_io import EngineCoreRequest

    core = llm.llm_engine.core
    core.add_request(
        EngineCoreRequest("raw-bad", [1, 10**9], SamplingParams(max_tokens=2), eos_token_id=1)
    )
    outputs = core.step()
    assert "raw-bad" in outputs.errors
    assert "outside the vocabulary" in outputs.errors["raw-bad"]
