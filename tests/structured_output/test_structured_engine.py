"""Structured output through the engine (`LLM`, tiny random models: only the grammar can make
the text valid): JSON schemas, regexes, choices and grammars hold for every sampled output,
neighbours without a grammar are untouched, a bad grammar fails its request only, and the mask
travels to worker processes (TP=2)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from inferengine import LLM, SamplingParams
from inferengine.errors import InvalidRequestError
from inferengine.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "kind": {"enum": ["cat", "dog"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "kind", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("qwen3")), max_model_len=512)


def _texts(llm, structured, n=50, max_tokens=160, seed=1, prompt="hello"):
    params = SamplingParams(
        temperature=1.0, max_tokens=max_tokens, n=n, seed=seed, structured_outputs=structured
    )
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return [(c.text, c.finish_reason) for c in out.outputs]


def test_every_finished_json_output_validates_against_its_schema(llm):
    outputs = _texts(llm, StructuredOutputsParams(json=SCHEMA), n=100)
    finished = [text for text, reason in outputs if reason == "stop"]
    assert len(finished) >= 90
    for text in finished:
        value = json.loads(text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])  # the schema's order
        outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
        assert not re.search(r"\s", outside_strings)  # compact: no whitespace between tokens


def test_regex_choice_grammar_and_json_object_hold_every_time(llm):
    for text, reason in _texts(llm, StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}")):
        assert reason == "stop" and re.fullmatch(r"[a-z]{3}-[0-9]{2}", text)
    choices = ["red", "green", "blue"]
    seen = {text for text, _ in _texts(llm, StructuredOutputsParams(choice=choices))}
    assert seen <= set(choices) and len(seen) > 1
    gbnf = 'root ::= "yes" | "no" | "n/a"'
    assert {t for t, _ in _texts(llm, StructuredOutputsParams(grammar=gbnf))} <= {
        "yes",
        "no",
        "n/a",
    }
    for text, reason in _texts(llm, StructuredOutputsParams(json_object=True), n=20):
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_requests_without_a_grammar_are_untouched_beside_one(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], plain, use_tqdm=False)
    constrained = SamplingParams(
        temperature=1.0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    mixed = llm.generate(
        [{"prompt_token_ids": [9, 10]}, {"prompt_token_ids": [5, 6, 7, 8]}],
        [constrained, plain],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_a_bad_grammar_is_refused_with_its_reason():
    with pytest.raises(InvalidRequestError, match="exactly one of"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")


def test_a_grammar_that_fails_to_build_fails_only_its_request(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9"), max_tokens=5)
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine = llm.llm_engine
    engine.add_request("bad", {"prompt_token_ids": [3, 4]}, bad)
    engine.add_request("good", {"prompt_token_ids": [3, 4]}, good)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].outputs[0].finish_reason == "abort"
    assert len(finished["good"].outputs[0].token_ids) == 4


def test_the_mask_reaches_worker_processes(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("qwen3")), max_model_len=256, tensor_parallel_size=2)
    try:
        outputs = _texts(llm, StructuredOutputsParams(regex=r"[0-9]{4}"), n=8, max_tokens=10)
    finally:
        llm.llm_engine.core.shutdown()
    assert all(reason == "stop" and re.fullmatch(r"[0-9]{4}", t) for t, reason in outputs)


def test_speculation_masks_every_draft_position(tiny_checkpoint):
    """n-gram drafts for a request under a grammar: each draft position is verified against
    masked logits, so the greedy tokens equal those without speculation, and drafts that
    follow the grammar are accepted."""
    path = str(tiny_checkpoint("qwen3"))
    structured = StructuredOutputsParams(regex=r"(abc-){6}[0-9]{4}")
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=structured)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 9, 2, 4]}]
    plain = LLM(path, max_model_len=256).generate(prompts, params, use_tqdm=False)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    speculating = LLM(path, max_model_len=256, speculative_config=spec)
    drafted = speculating.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert all(re.fullmatch(r"(abc-){6}[0-9]{4}", o.outputs[0].text) for o in drafted)
    assert speculating.llm_engine.core.scheduler.spec_stats.num_accepted_tokens > 0


def test_masks_made_while_the_next_forward_runs_give_the_same_text(tiny_checkpoint):
    """With async scheduling, a step's masks are made after the step before is collected
    (its forward already launched), and the step after it is launched before the outputs go
    back; the text equals one-step-at-a-time decoding's."""
    path = str(tiny_checkpoint("qwen3"))
    structured = StructuredOutputsParams(json=SCHEMA)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=120, structured_outputs=structured)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(2)]
    texts, deferred, in_flight = {}, [], {False: [], True: []}
    for mode in (False, True):
        llm = LLM(path, max_model_len=256, async_scheduling=mode)
        core = llm.llm_engine.core
        launch, step = core.executor.execute_model_async, core.step

        def stepping(step=step, core=core, seen=in_flight[mode]):
            outputs = step()
            seen.append(len(core._inflight))
            return outputs

        core.step = stepping

        def recording(so, launch=launch):
            deferred.append(so.grammar_deferred)
            return launch(so)

        llm.llm_engine.core.executor.execute_model_async = recording
        texts[mode] = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert texts[True] == texts[False]
    assert any(deferred) and not all(deferred)
    assert max(in_flight[False]) == 0 and max(in_flight[True]) == 2
    for text in texts[True]:
        jsonschema.validate(json.loads(text), SCHEMA)


def _first_new_token_from(tokens: list[int], start: int) -> int:
    """The index of the first token at or after `start` that did not occur before it."""
    return next(k for k in range(start, len(tokens)) if tokens[k] not in tokens[:k])


def test_a_reasoning_models_grammar_starts_after_its_end_token(llm):
    """Until the end-of-reasoning token the output is the unconstrained greedy one; after it,
    the grammar holds; a prompt that closed the block itself gets the grammar at once."""
    free = SamplingParams(temperature=0, max_tokens=16)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7]} for i in range(20)]
    outputs = llm.generate(prompts, free, use_tqdm=False)
    # a prompt whose greedy reply runs on (does not end at once)
    prompt, tokens = next(
        (p, o.outputs[0].token_ids)
        for p, o in zip(prompts, outputs, strict=True)
        if len(o.outputs[0].token_ids) == 16
    )
    k = _first_new_token_from(tokens, 2)
    end = tokens[k]
    structured = StructuredOutputsParams(
        regex=r"[0-9]{4}", reasoning_start_token_id=3, reasoning_end_token_id=end
    )
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=structured)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    got = out.outputs[0]
    assert got.token_ids[: k + 1] == tokens[: k + 1]
    assert got.finish_reason == "stop"
    assert re.fullmatch(
        r"[0-9]{4}", llm.get_tokenizer().decode(got.token_ids[k + 1 :], skip_special_tokens=True)
    )
    closed = {"prompt_token_ids": [3, 9, end, 5]}  # start ... end: reasoning already over
    (out,) = llm.generate([closed], params, use_tqdm=False)
    assert re.fullmatch(r"[0-9]{4}", out.outputs[0].text)


def test_a_tokenizer_llguidance_cannot_import_still_gets_its_grammar(tiny_checkpoint, tmp_path):
    """A checkpoint whose tokenizer has a bare `Fuse` decoder (llguidance's importer refuses
    it): JSON-schema requests still build and every finished output validates."""
    import shutil

    from tests.structured_output.test_token_bytes import fuse_tokenizer

    path = tmp_path / "fuse"
    shutil.copytree(tiny_checkpoint("qwen3"), path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    fuse_tokenizer().save_pretrained(path)
    llm = LLM(str(path), max_model_len=512)
    outputs = _texts(llm, StructuredOutputsParams(json=SCHEMA), n=30)
    finished = [text for text, reason in outputs if reason == "stop"]
    assert len(finished) >= 25
    for text in finished:
        jsonschema.validate(json.loads(text), SCHEMA)
    for text, reason in _texts(llm, StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"), n=10):
        assert reason == "stop" and re.fullmatch(r"[a-z]{3}-[0-9]{2}", text)
