"""The server through the official `openai` client: completions and chat, streamed and not."""

from __future__ import annotations

import pytest

from tests.entrypoints.openai.conftest import MAX_MODEL_LEN
from tests.entrypoints.openai.server import SERVED_NAME

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Hello world, how are you today?"}]
GREEDY = {"temperature": 0.0}


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str | None], list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_models_lists_the_served_name(openai_client, tiny_server):
    models = openai_client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert models[0].root.endswith("qwen3") or "qwen3" in models[0].root


def test_completion_greedy_matches_stream(openai_client):
    full = openai_client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.usage.prompt_tokens_details.cached_tokens >= 0
    stream = openai_client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        max_tokens=12,
        stream=True,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    texts, reasons, _ = _stream_text(stream)
    assert texts[0] == full.choices[0].text
    assert reasons[0] == "length"


def test_completion_default_max_tokens_is_16(openai_client):
    out = openai_client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 16


def test_chat_default_max_tokens_fills_the_context(openai_client, tiny_server):
    messages = [{"role": "user", "content": "Hello world, " * 68}]
    counted = tiny_server.client().post("/tokenize", json={"messages": messages}).json()
    assert MAX_MODEL_LEN - 40 < counted["count"] < MAX_MODEL_LEN
    out = openai_client.chat.completions.create(
        model=SERVED_NAME, messages=messages, extra_body={"ignore_eos": True}
    )
    assert out.usage.prompt_tokens == counted["count"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == MAX_MODEL_LEN


def test_chat_greedy_matches_stream(openai_client):
    full = openai_client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_completion_tokens=10, **GREEDY
    )
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    stream = openai_client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=10, stream=True, **GREEDY
    )
    texts, reasons, chunks = _stream_text(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts[0] == full.choices[0].message.content
    assert reasons[0] == full.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_n_2(openai_client, stream):
    kwargs = dict(model=SERVED_NAME, n=2, max_tokens=8, seed=7, temperature=1.0, stream=stream)
    out = openai_client.chat.completions.create(messages=MESSAGES, **kwargs)
    if stream:
        texts, reasons, _ = _stream_text(out)
        assert sorted(texts) == [0, 1] and sorted(reasons) == [0, 1]
    else:
        assert [c.index for c in out.choices] == [0, 1]
        assert all(isinstance(c.message.content, str) for c in out.choices)
        assert out.usage.completion_tokens <= 16
    out = openai_client.completions.create(prompt=PROMPT, **kwargs)
    indices = sorted(_stream_text(out)[0]) if stream else [c.index for c in out.choices]
    assert indices == [0, 1]


def test_batch_prompts_index_across_prompts_and_n(openai_client, tiny_server):
    ids = tiny_server.client().post("/tokenize", json={"prompt": "Hello"}).json()["tokens"]
    for prompt in ([PROMPT, "Hello"], [ids, ids[:1]]):
        out = openai_client.completions.create(
            model=SERVED_NAME, prompt=prompt, n=2, max_tokens=4, seed=1
        )
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert out.usage.completion_tokens <= 16
    single = openai_client.completions.create(
        model=SERVED_NAME, prompt=ids, max_tokens=4, temperature=0.0
    )
    text = openai_client.completions.create(
        model=SERVED_NAME, prompt="Hello", max_tokens=4, temperature=0.0
    )
    assert single.choices[0].text == text.choices[0].text


def test_completion_logprobs(openai_client):
    out = openai_client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    # Top-3 plus the sampled token, keyed by text (tokens that decode alike share a key).
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    assert all(tok in top for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_chat_logprobs(openai_client):
    out = openai_client.chat.completions.create(
        model=SERVED_NAME,
        messages=MESSAGES,
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 2
        first, second = entry.top_logprobs
        assert first.logprob >= second.logprob and entry.logprob <= first.logprob
        # A sampled token outside the top two ranks below both.
        if entry.token not in (first.token, second.token):
            assert entry.logprob <= second.logprob


def test_echo(openai_client):
    out = openai_client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=4, echo=True, logprobs=1, **GREEDY
    )
    choice = out.choices[0]
    assert choice.text.startswith(PROMPT)
    n_prompt = out.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == n_prompt + out.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    stream = openai_client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=4, echo=True, stream=True, **GREEDY
    )
    assert _stream_text(stream)[0][0] == choice.text


@pytest.mark.parametrize("include", [False, True])
def test_stop_string(openai_client, include):
    base = openai_client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True}, **GREEDY
    ).choices[0]
    text = base.text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip())
    expected = text[: text.find(stop)] + (stop if include else "")
    for stream in (False, True):
        out = openai_client.completions.create(
            model=SERVED_NAME,
            prompt=PROMPT,
            max_tokens=24,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True, "include_stop_str_in_output": include},
            **GREEDY,
        )
        if stream:
            texts, reasons, _ = _stream_text(out)
            assert (texts[0], reasons[0]) == (expected, "stop")
        else:
            assert (out.choices[0].text, out.choices[0].finish_reason) == (expected, "stop")


def test_seed_reproducible(openai_client):
    def sample(seed: int) -> str:
        return (
            openai_client.completions.create(
                model=SERVED_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_usage_in_last_chunk(openai_client, endpoint):
    kwargs = dict(
        model=SERVED_NAME,
        max_tokens=7,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    if endpoint == "chat":
        chunks = list(openai_client.chat.completions.create(messages=MESSAGES, **kwargs))
    else:
        chunks = list(openai_client.completions.create(prompt=PROMPT, **kwargs))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 14
    assert last.usage.total_tokens == last.usage.prompt_tokens + 14
    assert all(c.usage is None for c in chunks[:-1])
