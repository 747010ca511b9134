"""`cache_control` marks on chat messages become (prefix tokens, lease) breakpoints."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import inferengine.entrypoints.cache_breakpoints as cache_breakpoints_module
from inferengine.engine.input_processor import InputProcessor
from inferengine.entrypoints.cache_breakpoints import (
    cache_breakpoints,
    parse_cache_control,
    take_cache_control,
)
from inferengine.errors import InvalidRequestError
from tests.conftest import build_tokenizer

EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


@pytest.fixture(scope="module")
def processor() -> InputProcessor:
    config = SimpleNamespace(generation_config={}, hf_config={}, max_model_len=512)
    return InputProcessor(config, build_tokenizer())  # type: ignore[arg-type]


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You answer briefly.", "cache_control": HOUR},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Paris is the capital of France."},
                {"type": "text", "text": "Hello world", "cache_control": EPHEMERAL},
            ],
        },
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "how are you today?"},
    ]


def rendered_ids(processor: InputProcessor, messages: list[dict], **kwargs) -> list[int]:
    return processor.chat_prompt(messages, **kwargs)["prompt_token_ids"]


def test_take_cache_control_strips_marks_and_reads_leases():
    messages = conversation()
    stripped, leases = take_cache_control(messages)
    assert leases == {0: 3600.0, 1: 300.0}  # "5m" is the default ttl
    assert "cache_control" not in stripped[0]
    assert all("cache_control" not in part for part in stripped[1]["content"])
    assert messages == conversation()  # the caller's messages are left alone
    assert take_cache_control([{"role": "user", "content": "hi", "cache_control": None}]) == (
        [{"role": "user", "content": "hi"}],
        {},
    )


def test_the_longest_lease_of_a_message_wins():
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "a", "cache_control": HOUR},
            {"type": "text", "text": "b", "cache_control": EPHEMERAL},
        ],
    }
    assert take_cache_control([message])[1] == {0: 3600.0}


@pytest.mark.parametrize(
    ("mark", "param", "words"),
    [
        ({"type": "persistent"}, "cache_control.type", ["'persistent' is not supported"]),
        ({}, "cache_control.type", ["None is not supported"]),
        ("ephemeral", "cache_control", ["must be an object"]),
        ({"type": "ephemeral", "scope": "x"}, "cache_control", ["unknown field(s) ['scope']"]),
        ({"type": "ephemeral", "ttl": "forever"}, "cache_control.ttl", ["not understood"]),
        ({"type": "ephemeral", "ttl": "in_memory"}, "cache_control.ttl", ["must be a duration"]),
        ({"type": "ephemeral", "ttl": 300}, "cache_control.ttl", ["must be a string"]),
        ({"type": "ephemeral", "ttl": "30d"}, "cache_control.ttl", ["out of range"]),
    ],
)
def test_bad_cache_control(mark, param, words):
    with pytest.raises(InvalidRequestError) as info:
        parse_cache_control(mark)
    assert info.value.param == param
    for word in words:
        assert word in info.value.message
    if param != "cache_control.ttl":  # ttl errors are parse_retention's, which lists durations
        assert '{"type": "ephemeral"}' in info.value.message
        assert '"1h"' in info.value.message


def test_error_names_where_the_mark_is():
    messages = conversation()
    messages[1]["content"][1]["cache_control"] = {"type": "ephemeral", "ttl": "2 weeks"}
    with pytest.raises(InvalidRequestError) as info:
        take_cache_control(messages)
    assert info.value.param == "messages[1].content[1].cache_control.ttl"


def test_breakpoints_are_the_rendered_prefix_lengths(processor):
    messages, leases = take_cache_control(conversation())
    kwargs = {"add_generation_prompt": True, "chat_template": None}
    full = rendered_ids(processor, messages, **kwargs)
    got = cache_breakpoints(processor, messages, leases, full, kwargs)
    first = rendered_ids(processor, messages[:1], add_generation_prompt=False)
    second = rendered_ids(processor, messages[:2], add_generation_prompt=False)
    assert got == [(len(first), 3600.0), (len(second), 300.0)]
    assert full[: len(second)] == second and 0 < len(first) < len(second) < len(full)


def test_no_marks_render_nothing(processor):
    class Counting:
        calls = 0

        def chat_prompt(self, *args, **kwargs):
            Counting.calls += 1
            return processor.chat_prompt(*args, **kwargs)

    messages = [{"role": "user", "content": "hi"}]
    assert cache_breakpoints(Counting(), messages, {}, [1, 2, 3], {}) == []  # type: ignore[arg-type]
    assert Counting.calls == 0


def test_a_prefix_that_renders_differently_is_cut_to_the_common_prefix(processor):
    # The last message is rendered differently, so a prefix render is not a prefix of the prompt.
    template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
        "{% if loop.last %} (last){% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    messages = [
        {"role": "user", "content": "Hello world", "cache_control": EPHEMERAL},
        {"role": "user", "content": "how are you today?"},
    ]
    messages, leases = take_cache_control(messages)
    kwargs = {"add_generation_prompt": True, "chat_template": template}
    full = rendered_ids(processor, messages, **kwargs)
    prefix = rendered_ids(
        processor, messages[:1], add_generation_prompt=False, chat_template=template
    )
    assert full[: len(prefix)] != prefix
    common = next(k for k, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b)
    assert cache_breakpoints(processor, messages, leases, full, kwargs) == [(common, 300.0)]


def test_a_breakpoint_on_the_final_message_of_a_continued_reply(processor):
    messages, leases = take_cache_control(
        [
            {"role": "user", "content": "Hello world", "cache_control": EPHEMERAL},
            {"role": "assistant", "content": "Paris is", "cache_control": HOUR},
        ]
    )
    kwargs = {"add_generation_prompt": False, "chat_template": None, "continue_final_message": True}
    full = rendered_ids(processor, messages, **kwargs)
    first = rendered_ids(processor, messages[:1], add_generation_prompt=False)
    assert cache_breakpoints(processor, messages, leases, full, kwargs) == [
        (len(first), 300.0),
        (len(full), 3600.0),
    ]


def test_a_prefix_the_template_refuses_drops_only_that_breakpoint(processor, monkeypatch):
    warnings: list[str] = []  # the package logger does not propagate to caplog
    monkeypatch.setattr(
        cache_breakpoints_module.logger, "warning", lambda m, *a: warnings.append(m % a)
    )
    template = (
        "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('end with a user') }}{% endif %}"
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    messages, leases = take_cache_control(
        [
            {"role": "user", "content": "Hello world", "cache_control": EPHEMERAL},
            {"role": "assistant", "content": "Hello!", "cache_control": HOUR},
            {"role": "user", "content": "how are you today?"},
        ]
    )
    kwargs = {"add_generation_prompt": True, "chat_template": template}
    full = rendered_ids(processor, messages, **kwargs)
    first = rendered_ids(
        processor, messages[:1], add_generation_prompt=False, chat_template=template
    )
    assert cache_breakpoints(processor, messages, leases, full, kwargs) == [(len(first), 300.0)]
    (warning,) = warnings
    assert (
        warning.startswith("cache breakpoint on message 1 dropped") and "end with a user" in warning
    )
