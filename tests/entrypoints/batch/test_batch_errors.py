"""A bad row becomes an error record and the run goes on; the summary counts done, failed, skipped."""

from __future__ import annotations

import logging

import pytest

from inferengine.entrypoints.batch.runner import check_paths
from inferengine.errors import ConfigError
from tests.conftest import logged_messages
from tests.entrypoints.batch.helpers import (
    openai_line,
    read_jsonl,
    run,
    write_jsonl,
)

GOOD = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0}
LONG_PROMPT = "Hello world, how are you today? " * 60  # far over max_model_len=128


@pytest.fixture
def warnings():
    """Warnings from the package logger (it does not propagate to caplog)."""
    with logged_messages(logging.WARNING) as messages:
        yield messages


def test_bad_openai_rows_give_error_records(batch_llm, tmp_path, warnings):
    bad = {
        "invalid-json": '{"custom_id": "x", "method": ',
        "not-an-object": "[1, 2, 3]",
        "wrong-url": {**openai_line("wrong-url", GOOD), "url": "/v1/audio/speech"},
        "wrong-method": {**openai_line("wrong-method", GOOD), "method": "GET"},
        "too-long": openai_line("too-long", {**GOOD, "prompt": LONG_PROMPT}),
        "bad-top-p": openai_line("bad-top-p", {**GOOD, "top_p": 5}),
        "bad-type": openai_line("bad-type", {**GOOD, "max_tokens": "many"}),
        "no-messages": openai_line("no-messages", {"messages": [], "max_tokens": 4}),
        "stream": openai_line("stream", {**GOOD, "stream": True}),
        "bad-stop-token": openai_line("bad-stop-token", {**GOOD, "stop_token_ids": [10**6]}),
        "other-model": openai_line("other-model", {**GOOD, "model": "gpt-4o"}),
    }
    good = [openai_line(f"good-{i}", GOOD) for i in range(4)]
    # Unknown fields are ignored with a warning, as the server does.
    good[1] = {**good[1], "x_batch_line_field": 1}
    good[2] = openai_line("good-2", {**GOOD, "x_batch_body_field": 4})
    lines = [good[0], *list(bad.values())[:5], good[1], good[2], *list(bad.values())[5:], good[3]]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    summary = run(batch_llm, inp, tmp_path / "out.jsonl")
    assert (summary.done, summary.failed, summary.skipped) == (4, len(bad), 0)
    records = read_jsonl(tmp_path / "out.jsonl")
    assert len(records) == len(lines)
    by_id = {r["custom_id"]: r for r in records if isinstance(r["custom_id"], str)}
    for i in range(4):
        assert by_id[f"good-{i}"]["response"]["status_code"] == 200
        assert by_id[f"good-{i}"]["error"] is None
    for name in ("x_batch_line_field", "x_batch_body_field"):
        assert sum(name in w for w in warnings) == 1, warnings
    # Unreadable rows are known by their row index.
    assert {r["row_index"] for r in records if r["custom_id"] is None} == {1, 2}
    messages = {
        "wrong-url": "not supported",
        "wrong-method": "method must be POST",
        "too-long": "maximum context length",
        "bad-top-p": "top_p must be in",
        "bad-type": "max_tokens",
        "no-messages": "messages",
        "stream": "stream is not supported",
        "bad-stop-token": "outside the vocabulary",
        "other-model": "does not exist",
    }
    for custom_id, text in messages.items():
        record = by_id[custom_id]
        assert record["error"] is not None and text in record["error"]["message"], record
    # Errors the server would answer with carry its status code and error body.
    assert by_id["too-long"]["response"]["status_code"] == 400
    assert by_id["too-long"]["response"]["body"]["error"]["param"] == "prompt"
    assert by_id["other-model"]["response"]["status_code"] == 404
    assert by_id["wrong-url"]["response"] is None

    # A second run finds every row done, failed ones included, and changes nothing.
    before = (tmp_path / "out.jsonl").read_bytes()
    again = run(batch_llm, inp, tmp_path / "out.jsonl")
    assert (again.done, again.failed, again.skipped) == (0, 0, len(lines))
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_bad_plain_rows_give_error_records(batch_llm, tmp_path, warnings):
    rows = [
        GOOD,
        {"max_tokens": 4},  # no prompt
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        {"prompt": "x", "max_tokens": "abc"},
        {"prompt": "x", "output_text": "mine"},  # a column run-batch writes
        {"prompt": "x", "n": 2},
        {"prompt": LONG_PROMPT, "max_tokens": 4},
        {**GOOD, "custom_id": "last", "x_batch_column": "kept"},
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    summary = run(batch_llm, inp, tmp_path / "out.jsonl", input_format="jsonl")
    assert (summary.done, summary.failed) == (2, 6)
    records = {r["row_index"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert sorted(records) == list(range(len(rows)))
    assert records[0]["error"] is None and records[0]["completion_tokens"] == 4
    assert records[7]["custom_id"] == "last" and records[7]["error"] is None
    assert records[7]["x_batch_column"] == "kept"  # passed through, with one warning
    assert [w for w in warnings if "x_batch_column" in w and "passed through" in w], warnings
    assert not [w for w in warnings if "custom_id" in w], warnings
    for i in range(1, 7):
        assert records[i]["error"] and records[i]["output_text"] is None, records[i]


def test_rows_that_are_not_text_fail_alone(batch_llm, tmp_path):
    """A lone surrogate (JSON's "\\ud800") in any field, or bytes that are not UTF-8 in a CSV
    cell, fail their row with a message naming the field; the other rows complete."""
    lines = [
        openai_line("good-0", GOOD),
        openai_line("bad-prompt", {**GOOD, "prompt": "Hi \ud800"}),
        openai_line("bad-stop", {**GOOD, "stop": ["ok", "\udfff"]}),
        openai_line("bad-chat", {"messages": [{"role": "user", "content": "\ud800"}]}),
        {**openai_line("bad-line-field", GOOD), "x_\ud800": 1},
        openai_line("good-1", GOOD),
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)  # json.dumps escapes them as \uXXXX
    summary = run(batch_llm, inp, tmp_path / "out.jsonl")
    assert (summary.done, summary.failed) == (2, 4)
    records = {r.get("row_index", r["custom_id"]): r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert records["good-0"]["response"]["status_code"] == 200
    assert records["good-1"]["response"]["status_code"] == 200
    for row, field in [
        (1, "body.prompt"),
        (2, "body.stop[1]"),
        (3, "body.messages[0].content"),
        (4, "x_\\ud800"),
    ]:
        message = records[row]["error"]["message"]
        assert message.startswith(f"row {row}: {field} holds a lone UTF-16 surrogate"), message

    plain = tmp_path / "in.csv"
    plain.write_bytes(b"prompt,max_tokens\nHello,2\nbad \xff\xfe bytes,2\nWorld,2\n")
    summary = run(batch_llm, plain, tmp_path / "out.csv")
    assert (summary.done, summary.failed) == (2, 1)
    out = (tmp_path / "out.csv").read_text(encoding="utf-8")
    assert "row 1: column prompt is not UTF-8 text." in out, out


def test_defaults_fill_missing_fields(batch_llm, tmp_path):
    inp = write_jsonl(
        tmp_path / "in.jsonl", [{"prompt": "Hello"}, {"prompt": "Hi", "max_tokens": 2}]
    )
    defaults = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    run(batch_llm, inp, tmp_path / "out.jsonl", defaults=defaults)
    records = sorted(read_jsonl(tmp_path / "out.jsonl"), key=lambda r: r["row_index"])
    assert [r["completion_tokens"] for r in records] == [5, 2]


def test_bad_paths_fail_before_the_model_loads(tmp_path):
    from inferengine.entrypoints.batch import BatchConfig

    with pytest.raises(ConfigError, match="does not exist"):
        check_paths(BatchConfig(str(tmp_path / "none.jsonl"), str(tmp_path / "out.jsonl")))
    inp = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    with pytest.raises(ConfigError, match="matching name"):
        check_paths(BatchConfig(str(inp), str(tmp_path / "out.parquet")))
