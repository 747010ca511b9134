"""SamplingParams: normalisation of inputs and clear errors for values the engine cannot serve."""

from __future__ import annotations

import pytest

from inferengine.errors import InvalidRequestError
from inferengine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"n": 0}, "n", "at least 1"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_tokens": -5}, "max_tokens", "at least 1"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_p": -0.1}, "top_p", "(0, 1]"),
        ({"temperature": -0.5}, "temperature", "0 or more"),
        ({"top_k": -2}, "top_k", "-1"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "greater than 0"),
        ({"min_tokens": -1}, "min_tokens", "0 or more"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "must not exceed"),
        ({"logprobs": -1}, "logprobs", "0 or more"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "0 or more"),
        ({"stop": ["ok", ""]}, "stop", "empty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias", "[-100, 100]"),
        ({"seed": 2**63}, "seed", "64-bit"),
    ],
)
def test_bad_values_raise_invalid_request_error(kwargs, param, words):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    error = info.value
    assert error.param == param and error.status_code == 400
    assert words in error.message and param in error.message
    assert isinstance(error, ValueError)


def test_boundary_values_are_accepted():
    SamplingParams(n=1, max_tokens=1, top_p=1.0, temperature=0.0, top_k=0, min_p=1.0)
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.01)
    SamplingParams(min_tokens=4, max_tokens=4, logprobs=0, seed=-(2**63))
    SamplingParams(max_tokens=None, min_tokens=100, logit_bias={1: -100.0})


def test_inputs_are_normalised():
    params = SamplingParams(stop="###", top_k=-1, logit_bias={"7": 1})
    assert params.stop == ["###"] and params.top_k == 0 and params.logit_bias == {7: 1.0}
    params = SamplingParams(stop=("a", "b"), stop_token_ids=None)
    assert params.stop == ["a", "b"] and params.stop_token_ids == []
    assert SamplingParams().stop == []


def test_greedy_and_stop_ids():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    params = SamplingParams(stop_token_ids=[5, 6], extra_stop_token_ids=[6, 9])
    assert params.all_stop_token_ids == {5, 6, 9}


def test_verify_vocab_names_the_bad_token():
    SamplingParams(stop_token_ids=[0, 99], logit_bias={99: 1.0}).verify_vocab(100)
    for kwargs, param in [
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**kwargs).verify_vocab(100)
        assert info.value.param == param and "outside the vocabulary" in info.value.message


def test_clone_is_deep():
    params = SamplingParams(stop=["x"], logit_bias={1: 2.0})
    copy = params.clone()
    copy.stop.append("y")
    copy.logit_bias[2] = 3.0
    assert params.stop == ["x"] and params.logit_bias == {1: 2.0}
