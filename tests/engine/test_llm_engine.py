"""`LLMEngine`, the synchronous engine behind `LLM`: requests in, steps, `RequestOutput`s out;
`n` fanned out into child requests (each its own seed) and gathered back; aborts and stop
strings reach the engine core."""

from __future__ import annotations

import pytest
import torch

from inferengine.engine.arg_utils import EngineArgs
from inferengine.engine.input_processor import InputProcessor
from inferengine.engine.llm_engine import LLMEngine, child_params, fan_out
from inferengine.engine.output_processor import OutputProcessor
from inferengine.errors import ConfigError, InvalidRequestError
from inferengine.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import hf_greedy, hf_model

# qwen3's tiny model continues this prompt with varied tokens (not one token repeated)
PROMPT = torch.randint(2, 320, (12,), generator=torch.Generator().manual_seed(2)).tolist()


@pytest.fixture(scope="module")
def engine(path) -> LLMEngine:
    config = EngineArgs(model=path, max_model_len=128, max_num_seqs=8).create_engine_config()
    return LLMEngine(config)


@pytest.fixture(scope="module")
def reference(path) -> list[int]:
    return hf_greedy(hf_model(path), PROMPT, 12)


def run(engine: LLMEngine, max_steps: int = 200) -> dict[str, list]:
    """Step until nothing is left; every output, by request id."""
    outputs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("the engine did not finish")


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert not engine.core.scheduler.has_unfinished_requests()


# ---- child requests ----------------------------------------------------------------------


def test_child_params_take_seed_plus_index_and_n_one():
    params = SamplingParams(n=3, seed=10, temperature=0.7, stop=["x"])
    children = [child_params(params, i) for i in range(3)]
    assert [(c.n, c.seed) for c in children] == [(1, 10), (1, 11), (1, 12)]
    assert all(c.temperature == 0.7 and c.stop == ["x"] for c in children)
    assert (params.n, params.seed) == (3, 10)  # the user's params are left alone
    children[0].stop.append("y")
    assert params.stop == ["x"]  # a deep copy
    assert child_params(SamplingParams(n=2), 1).seed is None


def test_fan_out_checks_every_child_before_registering_any(engine):
    processor = InputProcessor(engine.config.model_config, engine.tokenizer)
    outputs = OutputProcessor(engine.tokenizer)
    params = SamplingParams(n=2, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="more than this model's maximum context"):
        fan_out(processor, outputs, "p", None, [5] * 129, params)
    assert outputs.requests == {} and outputs.parents == {}
    requests = fan_out(processor, outputs, "p", "text", [5, 6], params, priority=0)
    assert [r.request_id for r in requests] == ["0_p", "1_p"]
    assert [r.sampling_params.n for r in requests] == [1, 1]
    assert sorted(outputs.requests) == ["0_p", "1_p"] and list(outputs.parents) == ["p"]
    single = fan_out(processor, outputs, "q", None, [5], SamplingParams(max_tokens=1))
    assert [r.request_id for r in single] == ["q"]  # n = 1: the id as given


# ---- the step loop -----------------------------------------------------------------------


def test_greedy_tokens_and_text_match_transformers(engine, reference):
    engine.add_request("g", {"prompt_token_ids": PROMPT}, greedy())
    (*partial, final) = run(engine)["g"]
    assert final.finished and not any(o.finished for o in partial)
    (completion,) = final.outputs
    assert completion.token_ids == reference
    assert completion.finish_reason == "length"
    assert completion.text == engine.tokenizer.decode(reference, skip_special_tokens=True)
    assert final.prompt_token_ids == PROMPT and final.prompt is None
    assert_idle(engine)


def test_a_text_prompt_is_tokenized_and_kept(engine, path):
    engine.add_request("t", "Hello world", greedy(4, output_kind=RequestOutputKind.FINAL_ONLY))
    (final,) = run(engine)["t"]
    ids = engine.tokenizer.encode("Hello world")
    assert (final.prompt, final.prompt_token_ids) == ("Hello world", ids)
    assert final.outputs[0].token_ids == hf_greedy(hf_model(path), ids, 4)


def test_n_greedy_children_each_match_transformers(engine, reference):
    engine.add_request("n", {"prompt_token_ids": PROMPT}, greedy(n=3))
    final = run(engine)["n"][-1]
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.token_ids for c in final.outputs] == [reference] * 3
    assert_idle(engine)


def test_sampled_children_are_the_requests_of_their_seeds(engine):
    """Child i of `n` samples with seed + i: the same tokens as a lone request with that seed."""
    params = SamplingParams(n=2, seed=1234, temperature=1.0, max_tokens=8, ignore_eos=True)
    engine.add_request("s", {"prompt_token_ids": PROMPT}, params)
    for i in range(2):
        lone = SamplingParams(seed=1234 + i, temperature=1.0, max_tokens=8, ignore_eos=True)
        engine.add_request(f"lone{i}", {"prompt_token_ids": PROMPT}, lone)
    outputs = run(engine)
    children = [c.token_ids for c in outputs["s"][-1].outputs]
    assert children == [outputs[f"lone{i}"][-1].outputs[0].token_ids for i in range(2)]
    assert children[0] != children[1]


def test_a_stop_string_ends_the_request_in_the_core(engine, reference):
    text = engine.tokenizer.decode(reference[:6], skip_special_tokens=True)
    stop = text[-3:]  # ends inside the 6th token or before
    engine.add_request("stop", {"prompt_token_ids": PROMPT}, greedy(stop=[stop]))
    final = run(engine)["stop"][-1]
    (completion,) = final.outputs
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    full = engine.tokenizer.decode(reference, skip_special_tokens=True)
    assert completion.text == full[: full.find(stop)]
    assert len(completion.token_ids) <= 6
    assert_idle(engine)  # the core aborted it: no step runs past the stop


def test_abort_ends_a_request_in_both_halves(engine):
    engine.add_request("a", {"prompt_token_ids": PROMPT}, greedy(100))
    engine.add_request("b", {"prompt_token_ids": PROMPT}, greedy(3))
    engine.step()
    engine.abort_request(["a"])
    outputs = run(engine)
    assert "a" not in outputs or not outputs["a"][-1].finished
    assert outputs["b"][-1].finished
    assert_idle(engine)


def test_abort_of_an_n_request_aborts_its_children(engine):
    engine.add_request("fan", {"prompt_token_ids": PROMPT}, greedy(100, n=3))
    engine.step()
    engine.abort_request(["fan"])
    assert_idle(engine)
    assert engine.output_processor.parents == {}


def test_bad_requests_are_refused_before_reaching_the_core(engine):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("bad", {"prompt_token_ids": [5, 100000]}, greedy(n=2))
    assert_idle(engine)


def test_offline_engines_refuse_server_only_settings(path):
    config = EngineArgs(model=path, max_model_len=128, data_parallel_size=2).create_engine_config()
    with pytest.raises(ConfigError, match="--data-parallel-size runs replicas behind the server"):
        LLMEngine(config)
