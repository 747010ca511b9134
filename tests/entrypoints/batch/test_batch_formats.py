"""Every format round-trips, and its results equal `LLM.generate` / `LLM.chat` for the same rows."""

from __future__ import annotations

import csv
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from inferengine.entrypoints.batch.formats import detect_format
from inferengine.errors import ConfigError
from tests.entrypoints.batch.helpers import (
    expected,
    mixed_rows,
    openai_line,
    read_jsonl,
    run,
    write_jsonl,
)

RESULT_FIELDS = ("output_text", "finish_reason", "prompt_tokens", "completion_tokens")


def _result(record: dict) -> dict:
    return {k: record[k] for k in RESULT_FIELDS}


def test_openai_jsonl_matches_llm(batch_llm, tmp_path):
    rows = mixed_rows()
    lines = [openai_line(f"req-{i}", row) for i, row in enumerate(rows)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    summary = run(batch_llm, inp, tmp_path / "out.jsonl")
    assert (summary.done, summary.failed, summary.skipped) == (len(rows), 0, 0)
    records = {r["custom_id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
    assert sorted(records) == sorted(line["custom_id"] for line in lines)
    for i, row in enumerate(rows):
        record = records[f"req-{i}"]
        assert record["error"] is None and record["id"].startswith("batch_req_")
        response = record["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["id"] == response["request_id"]
        choice = body["choices"][0]
        if "messages" in row:
            assert body["object"] == "chat.completion"
            text = choice["message"]["content"]
        else:
            assert body["object"] == "text_completion"
            text = choice["text"]
        want = expected(batch_llm, row)
        got = {
            "output_text": text,
            "finish_reason": choice["finish_reason"],
            "prompt_tokens": body["usage"]["prompt_tokens"],
            "completion_tokens": body["usage"]["completion_tokens"],
        }
        assert got == want, row
        assert body["usage"]["total_tokens"] == got["prompt_tokens"] + got["completion_tokens"]


def test_openai_completion_with_several_prompts_and_n(batch_llm, tmp_path):
    body = {"prompt": ["Hello", "The quick"], "n": 2, "max_tokens": 4, "seed": 3}
    inp = write_jsonl(tmp_path / "in.jsonl", [openai_line("multi", body)])
    run(batch_llm, inp, tmp_path / "out.jsonl")
    (record,) = read_jsonl(tmp_path / "out.jsonl")
    choices = record["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert record["response"]["body"]["usage"]["completion_tokens"] == 16


def test_plain_jsonl_matches_llm_and_keeps_columns(batch_llm, tmp_path):
    rows = [{**row, "note": f"n{i}"} for i, row in enumerate(mixed_rows())]
    rows[0]["custom_id"] = "first"
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    assert detect_format(inp, None) == "jsonl"
    summary = run(batch_llm, inp, tmp_path / "out.jsonl")
    assert (summary.done, summary.failed) == (len(rows), 0)
    records = sorted(read_jsonl(tmp_path / "out.jsonl"), key=lambda r: r["row_index"])
    assert [r["row_index"] for r in records] == list(range(len(rows)))
    for row, record in zip(rows, records, strict=True):
        assert {k: record[k] for k in row} == row  # input columns pass through unchanged
        assert record["error"] is None
        clean = {k: v for k, v in row.items() if k not in ("note", "custom_id")}
        assert _result(record) == expected(batch_llm, clean)


def test_csv_matches_llm_and_keeps_columns(batch_llm, tmp_path):
    rows = mixed_rows()
    columns = ["note", "prompt", "messages", "temperature", "top_p", "top_k", "seed"]
    columns += ["max_tokens", "stop"]
    with open(tmp_path / "in.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        for i, row in enumerate(rows):
            cells = {k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()}
            writer.writerow({"note": f"line {i},\nwith a comma", **cells})
    summary = run(batch_llm, tmp_path / "in.csv", tmp_path / "out.csv")
    assert (summary.done, summary.failed) == (len(rows), 0)
    with open(tmp_path / "out.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == [*columns, "row_index", *RESULT_FIELDS, "error"]
        records = sorted(reader, key=lambda r: int(r["row_index"]))
    for i, (row, record) in enumerate(zip(rows, records, strict=True)):
        assert record["note"] == f"line {i},\nwith a comma"
        want = {k: str(v) for k, v in expected(batch_llm, row).items()}
        assert _result(record) == want
        assert record["error"] == ""


def test_parquet_matches_llm_and_keeps_types(batch_llm, tmp_path):
    rows = [{"id": i, **row} for i, row in enumerate(mixed_rows())]
    columns = {k: None for row in rows for k in row}
    rows = [{**columns, **row} for row in rows]  # from_pylist takes its columns from row 0
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=4)
    summary = run(batch_llm, tmp_path / "in.parquet", tmp_path / "out.parquet")
    assert (summary.done, summary.failed) == (len(rows), 0)
    assert not (tmp_path / "out.parquet.parts").exists()
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("id").type == pa.int64()
    assert table.schema.field("completion_tokens").type == pa.int64()
    records = sorted(table.to_pylist(), key=lambda r: r["row_index"])
    for row, record in zip(rows, records, strict=True):
        assert record["id"] == row["id"] and record["error"] is None
        clean = {k: v for k, v in row.items() if v is not None and k != "id"}
        assert _result(record) == expected(batch_llm, clean)


def test_ordered_writes_in_input_order(batch_llm, tmp_path):
    # Long rows first, so completion order differs from input order.
    lines = [
        openai_line(f"r{i}", {"prompt": "Hello", "max_tokens": 24 - 2 * i, "ignore_eos": True})
        for i in range(10)
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    run(batch_llm, inp, tmp_path / "out.jsonl", ordered=True, max_in_flight=4)
    assert [r["custom_id"] for r in read_jsonl(tmp_path / "out.jsonl")] == [
        f"r{i}" for i in range(10)
    ]


def test_format_detection_and_mismatched_output(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [openai_line("a", {"prompt": "x"})])
    assert detect_format(inp, None) == "openai"
    assert detect_format(inp, "jsonl") == "jsonl"
    with pytest.raises(ConfigError, match="extension"):
        detect_format(tmp_path / "in.txt", None)
    from inferengine.entrypoints.batch.formats import check_output_path

    with pytest.raises(ConfigError, match="matching name"):
        check_output_path(tmp_path / "out.csv", "openai")
