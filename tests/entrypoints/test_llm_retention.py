"""`LLM.generate` / `LLM.chat` session arguments and `cache_control` marks reach `EngineCoreRequest`."""

from __future__ import annotations

import pytest

from inferengine import LLM, SamplingParams
from inferengine.core.engine_io import EngineCoreRequest
from inferengine.errors import InvalidRequestError
from tests.conftest import spy_core_requests

HOUR = {"type": "ephemeral", "ttl": "1h"}


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama3-tied")), max_model_len=128)


@pytest.fixture
def sent(llm, monkeypatch) -> list[EngineCoreRequest]:
    """The requests `llm` hands its engine core."""
    return spy_core_requests(llm, monkeypatch)


def test_generate_retention_reaches_every_core_request(llm, sent):
    params = SamplingParams(max_tokens=2, n=2)
    outputs = llm.generate(
        ["Hello world", "Paris is"],
        params,
        use_tqdm=False,
        prompt_cache_key="session-1",
        prompt_cache_retention="1h",
    )
    assert len(outputs) == 2 and len(sent) == 4
    for request in sent:
        assert request.cache_key == "session-1"
        assert request.cache_ttl_s == 3600.0
        assert request.cache_breakpoints == []


def test_generate_without_retention_leases_nothing(llm, sent):
    llm.generate("Hello world", SamplingParams(max_tokens=1), use_tqdm=False)
    ((key, ttl, breakpoints),) = [(r.cache_key, r.cache_ttl_s, r.cache_breakpoints) for r in sent]
    assert (key, ttl, breakpoints) == (None, None, [])


@pytest.mark.parametrize("call", ["generate", "chat"])
@pytest.mark.parametrize("value", ["forever", "0s", "", 3600])
def test_bad_retention_raises_before_anything_is_queued(llm, sent, call, value):
    with pytest.raises(InvalidRequestError, match="prompt_cache_retention") as info:
        if call == "generate":
            llm.generate("Hello", use_tqdm=False, prompt_cache_retention=value)
        else:
            llm.chat([{"role": "user", "content": "hi"}], prompt_cache_retention=value)
    assert info.value.param == "prompt_cache_retention"
    assert sent == [] and not llm.llm_engine.has_unfinished_requests()


def test_chat_breakpoints_are_the_rendered_prefix_lengths(llm, sent):
    tokenizer = llm.get_tokenizer()
    conversations = [
        [
            {"role": "system", "content": "You answer briefly.", "cache_control": HOUR},
            {"role": "user", "content": "Paris is the capital of"},
        ],
        [{"role": "user", "content": "Hello world"}],
    ]
    llm.chat(
        conversations,
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        prompt_cache_key="s",
        prompt_cache_retention="10m",
    )
    first = tokenizer.encode(
        tokenizer.apply_chat_template(
            [{"role": "system", "content": "You answer briefly."}],
            tokenize=False,
            add_generation_prompt=False,
        ),
        add_special_tokens=False,
    )
    marked, plain = sent
    assert (marked.cache_key, marked.cache_ttl_s) == ("s", 600.0)
    assert marked.cache_breakpoints == [(len(first), 3600.0)]
    assert marked.prompt_token_ids[: len(first)] == first
    assert len(first) < len(marked.prompt_token_ids)
    assert (plain.cache_key, plain.cache_ttl_s, plain.cache_breakpoints) == ("s", 600.0, [])
    # The mark changes no prompt token.
    unmarked = [{k: v for k, v in m.items() if k != "cache_control"} for m in conversations[0]]
    sent.clear()
    llm.chat(unmarked, SamplingParams(max_tokens=1), use_tqdm=False)
    assert sent[0].prompt_token_ids == marked.prompt_token_ids


def test_chat_bad_cache_control_raises_before_anything_is_queued(llm, sent):
    messages = [{"role": "user", "content": "hi", "cache_control": {"type": "persistent"}}]
    with pytest.raises(InvalidRequestError, match="ephemeral") as info:
        llm.chat(messages)
    assert info.value.param == "messages[0].cache_control.type"
    assert sent == []
