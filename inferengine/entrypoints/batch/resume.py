"""Resuming: each row's identity, the rows an output already holds, and cutting off a half-written tail.

A row is known by its `custom_id` (key `c:<id>`), or by its 0-based row index (key `r:<index>`)
when it has none. A crash can leave at most the last record half-written, because records are
appended one at a time; recovery truncates the file to the end of its last complete record. A bad
record anywhere before the end is not a crash's doing, so it stops the run instead.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from inferengine.errors import ConfigError
from inferengine.logger import init_logger

logger = init_logger(__name__)


def missing(value: Any) -> bool:
    """An absent cell: None, an empty CSV cell, or a NaN from a pandas-written file."""
    return value is None or value == "" or (isinstance(value, float) and math.isnan(value))


def row_key(custom_id: Any, row_index: int) -> str:
    return f"r:{row_index}" if missing(custom_id) else f"c:{custom_id}"


def record_key(record: dict[str, Any], fmt: str) -> str:
    """The key of a result record; OpenAI records carry `row_index` when `custom_id` is no string."""
    custom_id = record.get("custom_id")
    if fmt == "openai" and not isinstance(custom_id, str):
        custom_id = None
    row_index = record.get("row_index")
    if missing(custom_id) and missing(row_index):
        raise ValueError("the record has neither custom_id nor row_index")
    return row_key(custom_id, 0 if missing(row_index) else int(row_index))


def _truncate(path: Path, good_end: int) -> None:
    size = path.stat().st_size
    if size > good_end:
        logger.warning(
            "%s ends in a half-written record (%d bytes, from an interrupted run); cutting it off "
            "and redoing that row.",
            path,
            size - good_end,
        )
        os.truncate(path, good_end)


def _corrupt(path: Path, where: str, error: Exception) -> ConfigError:
    return ConfigError(
        f"{where} of {path} is not a run-batch result ({error}); fix or remove it, or write to "
        "another output file."
    )


# ---- JSONL -----------------------------------------------------------------------------------


def recover_jsonl(path: Path, fmt: str) -> set[str]:
    """Keys of the rows `path` holds; a partial last line is cut off."""
    keys: set[str] = set()
    if not path.exists():
        return keys
    good_end = 0
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                break
            try:
                keys.add(record_key(json.loads(raw), fmt))
            except (ValueError, TypeError, AttributeError) as e:
                if f.read(1):
                    raise _corrupt(path, f"line {line_number}", e) from e
                break
            good_end += len(raw)
    _truncate(path, good_end)
    return keys


# ---- CSV -------------------------------------------------------------------------------------


def recover_csv(path: Path, header: list[str]) -> set[str]:
    """Keys of the rows a CSV output holds; a partial last record (which may span lines, since
    quoted cells hold newlines) is cut off. The header must be the one this run writes."""
    keys: set[str] = set()
    if not path.exists() or path.stat().st_size == 0:
        return keys
    csv.field_size_limit(sys.maxsize)
    size = path.stat().st_size
    state = {"pos": 0, "complete": True}

    def lines(f: Any) -> Iterator[str]:
        for raw in f:
            state["pos"] += len(raw)
            state["complete"] = raw.endswith(b"\n")
            yield raw.decode("utf-8")

    good_end = 0
    with open(path, "rb") as f:
        reader = csv.reader(lines(f), strict=True)
        number = 1  # the record being read, for the message
        try:
            first = next(reader, None)
            if first is not None and state["complete"]:
                if first != header:
                    raise ConfigError(
                        f"{path} has the columns {first}, but this run writes {header}; write "
                        "to another output file."
                    )
                good_end = state["pos"]
                for record in reader:
                    if not state["complete"] or len(record) != len(header):
                        raise ValueError(f"{len(record)} cells, expected {len(header)}")
                    keys.add(record_key(dict(zip(header, record, strict=True)), "csv"))
                    good_end = state["pos"]
                    number += 1
        except ConfigError:
            raise
        except (csv.Error, UnicodeDecodeError, ValueError) as e:
            if state["pos"] < size:
                raise _corrupt(path, f"record {number}", e) from e
    _truncate(path, good_end)
    return keys


# ---- Parquet ---------------------------------------------------------------------------------


def recover_parquet(path: Path, parts_dir: Path, schema: Any) -> set[str]:
    """Keys held by a finished output and by the parts of an unfinished run. Half-written files
    (`*.tmp`) are removed; a part whose rows are already in the output (a crash between the
    merge and the clean-up) is removed too."""
    for tmp in [path.with_name(path.name + ".tmp"), *parts_dir.glob("*.tmp")]:
        tmp.unlink(missing_ok=True)
    merged = _parquet_keys(path, schema) if path.exists() else set()
    keys = set(merged)
    for part in sorted(parts_dir.glob("part-*.parquet")):
        part_keys = _parquet_keys(part, schema)
        if part_keys & merged:
            part.unlink()
            continue
        keys |= part_keys
    return keys


def _parquet_keys(path: Path, schema: Any) -> set[str]:
    import pyarrow.parquet as pq

    try:
        found = pq.read_schema(path)
    except Exception as e:
        raise _corrupt(path, "the file", e) from e
    if not found.equals(schema, check_metadata=False):
        raise ConfigError(
            f"{path} was written from a differently shaped input (its columns: "
            f"{found.names}); write to another output file."
        )
    columns = ["row_index"] + (["custom_id"] if "custom_id" in schema.names else [])
    table = pq.read_table(path, columns=columns)
    return {record_key(r, "parquet") for r in table.to_pylist()}
