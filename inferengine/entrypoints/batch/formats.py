"""Batch input files: format detection and lazy row readers (JSONL, OpenAI Batch JSONL, CSV, Parquet)."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inferengine.entrypoints.openai.text_check import lone_surrogate_error, lone_surrogate_path
from inferengine.errors import ConfigError

FORMATS = ("openai", "jsonl", "csv", "parquet")
_EXTENSIONS = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
# What run-batch adds to each row of a plain (JSONL, CSV, Parquet) file.
OUTPUT_COLUMNS = (
    "row_index",
    "output_text",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "error",
)
_PARQUET_BATCH_ROWS = 1024


@dataclass(slots=True)
class InputRow:
    """One row: `index` is its 0-based position among the file's rows (blank lines are not rows)."""

    index: int
    data: dict[str, Any] | None  # None when the row could not be read
    read_error: str | None = None


@dataclass
class InputFile:
    path: Path
    format: str
    rows: Iterator[InputRow]
    total: int | None = None  # rows in the file, when cheap to know
    columns: list[str] | None = None  # CSV header
    arrow_schema: Any = None  # Parquet schema (pyarrow.Schema)


def detect_format(path: Path, given: str | None) -> str:
    """The format named by `--input-format`, else by the extension; `.jsonl` files are
    OpenAI Batch files when their first row has `custom_id` and `body`."""
    if given is not None:
        if given not in FORMATS:
            raise ConfigError(f"--input-format must be one of {', '.join(FORMATS)}; got {given!r}.")
        return given
    family = _EXTENSIONS.get(path.suffix.lower())
    if family is None:
        raise ConfigError(
            f"cannot tell the format of {path} from its extension; name it .jsonl, .csv or "
            f".parquet, or pass --input-format {{{','.join(FORMATS)}}}."
        )
    if family != "jsonl":
        return family
    first = _first_jsonl_object(path)
    return "openai" if first is not None and {"custom_id", "body"} <= first.keys() else "jsonl"


def check_output_path(output: Path, fmt: str) -> None:
    """The output has the input's format; refuse an extension that says otherwise."""
    family = _EXTENSIONS.get(output.suffix.lower())
    expected = "jsonl" if fmt == "openai" else fmt
    if family is not None and family != expected:
        raise ConfigError(
            f"the output is written in the input's format ({fmt}), but {output} has a "
            f"{output.suffix} extension; give the output a matching name."
        )


def open_input(path: Path, fmt: str) -> InputFile:
    if not path.exists():
        raise ConfigError(f"input file {path} does not exist.")
    if fmt in ("openai", "jsonl"):
        return InputFile(path, fmt, _jsonl_rows(path), total=_count_lines(path))
    if fmt == "csv":
        columns = _csv_header(path)
        return InputFile(path, fmt, _csv_rows(path), columns=columns)
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    return InputFile(
        path,
        fmt,
        _parquet_rows(parquet),
        total=parquet.metadata.num_rows,
        arrow_schema=parquet.schema_arrow,
    )


# ---- JSONL -----------------------------------------------------------------------------------


def _jsonl_rows(path: Path) -> Iterator[InputRow]:
    index = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            yield _parse_json_row(index, raw)
            index += 1


def _parse_json_row(index: int, raw: bytes) -> InputRow:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return InputRow(index, None, f"row {index} is not valid JSON: {e}")
    if not isinstance(data, dict):
        return InputRow(index, None, f"row {index} is not a JSON object.")
    path = lone_surrogate_path(data)
    if path is not None:  # the tokenizer and the output file could not take it
        return InputRow(index, None, f"row {index}: {lone_surrogate_error(path).message}")
    return InputRow(index, data)


def _first_jsonl_object(path: Path) -> dict[str, Any] | None:
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    data = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return None
                return data if isinstance(data, dict) else None
    return None


def _count_lines(path: Path) -> int:
    """Non-blank lines, counted in large binary chunks (fast enough for files of GBs)."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    if last != b"\n":
        count += 1
    return count


# ---- CSV -------------------------------------------------------------------------------------


def _csv_header(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
        header = next(csv.reader(f), None)
    if not header:
        raise ConfigError(f"{path} has no header row; the first row must name the columns.")
    if lone_surrogate_path(header) is not None:
        raise ConfigError(f"the header row of {path} is not UTF-8 text.")
    return header


def _csv_rows(path: Path) -> Iterator[InputRow]:
    csv.field_size_limit(sys.maxsize)
    # Bytes that are not UTF-8 come through as lone surrogates, and fail only their row.
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
        reader = csv.DictReader(f)
        for index, row in enumerate(reader):
            if None in row:
                yield InputRow(index, None, f"row {index} has more cells than the header.")
                continue
            column = lone_surrogate_path(row)
            if column is not None:
                yield InputRow(index, None, f"row {index}: column {column} is not UTF-8 text.")
                continue
            yield InputRow(index, row)


# ---- Parquet ---------------------------------------------------------------------------------


def _parquet_rows(parquet: Any) -> Iterator[InputRow]:
    index = 0
    for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for data in batch.to_pylist():
            yield InputRow(index, data)
            index += 1
