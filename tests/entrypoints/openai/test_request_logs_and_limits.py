"""Request logging (off by default, one line per request, parameters cut), unknown fields (a
warning once per name, the `X-Unknown-Fields` header) and fan-out limits (`n`, prompts x n), on a
stand-in engine: the test tokenizer and a real `InputProcessor`, generation never runs."""

from __future__ import annotations

import argparse
import asyncio
import logging
from types import SimpleNamespace

import pytest
from fastapi.responses import Response

from inferengine.engine.input_processor import InputProcessor
from inferengine.entrypoints.openai.api_server import UNKNOWN_FIELDS_HEADER, _reply
from inferengine.entrypoints.openai.config import ServerConfig
from inferengine.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from inferengine.entrypoints.openai.serving_chat import ServingChat
from inferengine.entrypoints.openai.serving_completions import ServingCompletion
from inferengine.entrypoints.openai.serving_engine import RequestLimits, warn_unknown_fields
from inferengine.entrypoints.openai.streaming import close_streams
from inferengine.errors import ConfigError, InvalidRequestError
from tests.conftest import EOS_ID, build_tokenizer, logged_messages


@pytest.fixture(scope="module")
def engine():
    tokenizer = build_tokenizer()
    model_config = SimpleNamespace(
        name="tiny",
        max_model_len=512,
        generation_config={},
        hf_config={"eos_token_id": EOS_ID},
        vocab_size=len(tokenizer),
    )

    async def generate(prompt, params, request_id, **kwargs):
        await asyncio.Event().wait()  # never produces: these tests stop at submission
        yield

    return SimpleNamespace(
        model_config=model_config,
        tokenizer=tokenizer,
        input_processor=InputProcessor(model_config, tokenizer),  # type: ignore[arg-type]
        generate=generate,
    )


@pytest.fixture
def lines():
    """INFO and above from the package logger (it does not propagate to caplog)."""
    with logged_messages(logging.INFO) as messages:
        yield messages


def submit(serving: ServingCompletion, **fields) -> int:
    """Prepare and submit a completions request; the number of engine requests it became."""
    req = CompletionRequest.model_validate({"max_tokens": 4, **fields})

    async def go() -> int:
        prompts, params, retention = serving.prepare(req)
        inputs = [p.engine_input() for p in prompts]
        streams = await serving.start("cmpl-test", inputs, params, req, retention)
        await close_streams(streams)
        return len(streams)

    return asyncio.run(go())


MANY = [[5, 6, 7]] * 10_000


def test_request_logging_is_off_by_default(engine, lines):
    assert submit(ServingCompletion(engine), prompt=MANY) == 10_000
    assert lines == []


def test_request_logging_writes_one_line_per_request(engine, lines):
    assert submit(ServingCompletion(engine, log_requests=True), prompt=MANY) == 10_000
    assert len(lines) == 1
    assert lines[0].startswith("request cmpl-test: 10000 prompt(s), 30000 prompt tokens, n=1")


def test_logged_parameters_are_cut_to_max_log_len(engine, lines):
    serving = ServingCompletion(engine, True, RequestLimits(max_log_len=100))
    submit(serving, prompt="Hello", stop=["x" * 1_000_000])
    assert len(lines) == 1 and len(lines[0]) < 250, lines[0][:300]
    assert "more chars]" in lines[0]


def test_n_above_the_limit_is_a_400_naming_it(engine):
    for serving, req in (
        (ServingCompletion(engine), CompletionRequest(prompt="Hi", n=129)),
        (
            ServingChat(engine),
            ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], n=129),
        ),
    ):
        with pytest.raises(InvalidRequestError) as info:
            serving.prepare(req)  # type: ignore[arg-type]
        assert info.value.param == "n" and "at most 128" in info.value.message
    with pytest.raises(InvalidRequestError):
        ServingCompletion(engine, limits=RequestLimits(max_n=4)).prepare(
            CompletionRequest(prompt="Hi", n=5)
        )
    ServingCompletion(engine).prepare(CompletionRequest(prompt="Hi", n=128, max_tokens=1))


def test_too_many_prompts_times_n_is_a_400_that_says_so(engine):
    serving = ServingCompletion(engine, limits=RequestLimits(max_request_seqs=100))
    serving.prepare(CompletionRequest(prompt=[[5, 6]] * 50, n=2, max_tokens=1))
    with pytest.raises(InvalidRequestError) as info:
        serving.prepare(CompletionRequest(prompt=[[5, 6]] * 51, n=2, max_tokens=1))
    assert info.value.param == "prompt"
    assert "102 sequences" in info.value.message and "--max-request-seqs" in info.value.message


def test_unknown_fields_warn_once_per_name_and_come_back_in_a_header(engine, lines):
    body = {"prompt": "Hi", "max_tokens": 1, "x_test_field_a": 1, "x_test_field_b\n": 2}
    for _ in range(3):
        req = CompletionRequest.model_validate(body | {"best_of": 1})  # best_of=1 asks nothing
        ServingCompletion(engine).prepare(req)
        response = _reply(Response("{}"), req)
        assert response.headers[UNKNOWN_FIELDS_HEADER] == "x_test_field_a, x_test_field_b\\n"
    assert len(lines) == 1 and "x_test_field_a, x_test_field_b\\n" in lines[0], lines
    warn_unknown_fields(["x_test_field_a", "x_test_field_c"])
    assert len(lines) == 2 and "x_test_field_a" not in lines[1]
    known = CompletionRequest.model_validate({"prompt": "Hi"})
    assert UNKNOWN_FIELDS_HEADER not in _reply(Response("{}"), known).headers


def test_warned_field_names_are_bounded_in_characters(lines, monkeypatch):
    from inferengine.entrypoints.openai import serving_engine

    monkeypatch.setattr(serving_engine, "_warned_fields", set())
    monkeypatch.setattr(serving_engine, "_warned_chars", 0)
    for batch in range(20):  # 2000 distinct names of 100k characters each
        warn_unknown_fields(f"{i:05d}{batch}" + "x" * 100_000 for i in range(100))
    kept = serving_engine._warned_fields
    assert 0 < len(kept) < 1024  # the character budget ran out before the count did
    assert sum(map(len, kept)) <= serving_engine._MAX_WARNED_CHARS
    assert max(map(len, kept)) < 100
    assert lines and all(len(line) < 1200 for line in lines)


def test_log_and_limit_flags(lines):
    from inferengine.entrypoints.cli.serve import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = parser.parse_args([])
    assert (args.enable_log_requests, args.max_log_len, args.max_n) == (False, 2048, 128)
    old = parser.parse_args(["--disable-log-requests"])  # vLLM's old flag: accepted, a no-op
    assert lines == []
    ServerConfig(disable_log_requests=old.disable_log_requests)
    assert len(lines) == 1 and "deprecated" in lines[0]
    with pytest.raises(ConfigError, match="--max-n"):
        ServerConfig(max_n=0)
