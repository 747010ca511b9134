"""`parse_retention` turns OpenAI/Anthropic durations into lease seconds and explains bad ones."""

from __future__ import annotations

import pytest

from inferengine.errors import InvalidRequestError
from inferengine.retention import Retention, parse_retention


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        ("in_memory", None),
        ("600s", 600.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("24h", 86400.0),
        ("1.5h", 5400.0),
        ("500ms", 0.5),
        ("7d", 7 * 86400.0),
        (" 10 m ", 600.0),
    ],
)
def test_accepted(value, seconds):
    assert parse_retention(value) == seconds


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("", ["'' is not understood", '"in_memory"', "(ms, s, m, h, d)", '"600s"', '"24h"']),
        ("10", ["'10' is not understood", "with a unit"]),
        ("-5s", ["'-5s' is not understood", "positive duration"]),
        ("1y", ["'1y' is not understood", "(ms, s, m, h, d)"]),
        ("in-memory", ["'in-memory' is not understood", '"in_memory"']),
        ("0s", ["'0s' is out of range", "more than 0 s", "at most 7 days"]),
        ("8d", ["'8d' is out of range", "at most 7 days"]),
        (600, ["must be a string", '"in_memory"', '"600s"']),
        (1.5, ["must be a string"]),
        (["1h"], ["must be a string"]),
    ],
)
def test_refused_with_a_message_naming_the_field(value, words):
    with pytest.raises(InvalidRequestError) as info:
        parse_retention(value, "prompt_cache_retention")
    error = info.value
    assert error.message.startswith("prompt_cache_retention ")
    assert error.param == "prompt_cache_retention"
    assert error.status_code == 400
    for word in words:
        assert word in error.message


def test_field_name_is_the_callers():
    with pytest.raises(InvalidRequestError, match=r"^messages\[0\]\.cache_control\.ttl") as info:
        parse_retention("soon", "messages[0].cache_control.ttl")
    assert info.value.param == "messages[0].cache_control.ttl"


def test_retention_parse():
    assert Retention.parse(None, None) == Retention()
    assert Retention.parse("s1", "1h") == Retention(key="s1", ttl_s=3600.0)
    assert Retention.parse("s1", "in_memory") == Retention(key="s1")
    with pytest.raises(InvalidRequestError, match="prompt_cache_key must be a string") as info:
        Retention.parse(7, None)  # type: ignore[arg-type]
    assert info.value.param == "prompt_cache_key"
    with pytest.raises(InvalidRequestError) as info:
        Retention.parse("s1", "1 hour")
    assert info.value.param == "prompt_cache_retention"
