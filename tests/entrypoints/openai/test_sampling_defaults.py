"""Requests that leave a sampling field unset get the model's generation_config.json value;
a field the client sets wins, even when it equals the built-in default."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from inferengine.engine.input_processor import InputProcessor
from inferengine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from inferengine.entrypoints.openai.serving_chat import ServingChat
from inferengine.entrypoints.openai.serving_completions import ServingCompletion
from tests.conftest import EOS_ID, build_tokenizer

MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7}


@pytest.fixture(scope="module")
def engine():
    tokenizer = build_tokenizer()
    model_config = SimpleNamespace(
        name="tiny",
        max_model_len=512,
        generation_config={"eos_token_id": EOS_ID, **MODEL_DEFAULTS},
        hf_config={"eos_token_id": EOS_ID},
        vocab_size=len(tokenizer),
    )
    return SimpleNamespace(
        model_config=model_config,
        tokenizer=tokenizer,
        input_processor=InputProcessor(model_config, tokenizer),  # type: ignore[arg-type]
    )


def chat_params(engine, **fields):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **fields}
    )
    return ServingChat(engine, log_requests=False).prepare(req)[1]


def completion_params(engine, **fields):
    req = CompletionRequest.model_validate({"prompt": "hi", **fields})
    return ServingCompletion(engine, log_requests=False).prepare(req)[1][0]


@pytest.mark.parametrize("params", [chat_params, completion_params])
def test_unset_fields_take_the_model_defaults(engine, params):
    p = params(engine)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.2, 0.9, 20, 7)
    assert (p.min_p, p.repetition_penalty) == (0.0, 1.0)  # not in the file: built-in


@pytest.mark.parametrize("params", [chat_params, completion_params])
def test_fields_the_client_sets_win(engine, params):
    p = params(engine, temperature=1.0, top_p=1.0, max_tokens=3)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 20, 3)
    assert params(engine, temperature=0).temperature == 0.0
    assert params(engine, temperature=None).temperature == 0.2  # JSON null: unset


def test_run_batch_rows_share_the_defaults(engine):
    from inferengine.entrypoints.batch.formats import InputRow
    from inferengine.entrypoints.batch.mapping import RowMapper

    llm_engine = SimpleNamespace(
        config=SimpleNamespace(model_config=engine.model_config),
        tokenizer=engine.tokenizer,
        input_processor=engine.input_processor,
    )
    mapper = RowMapper(llm_engine, "jsonl", {"top_p": 0.5})  # type: ignore[arg-type]
    unset = mapper.prepare(InputRow(0, {"prompt": "hi"})).params[0]
    assert (unset.temperature, unset.top_p, unset.max_tokens) == (0.2, 0.5, 7)
    row = {"messages": [{"role": "user", "content": "hi"}], "temperature": 1.0}
    assert mapper.prepare(InputRow(1, row)).params[0].temperature == 1.0
