"""Batch output files, appended a record at a time and readable again for resuming.

JSONL and CSV outputs are appended to and flushed after every engine step. A Parquet file cannot
be appended to, so a Parquet run writes numbered part files beside the output
(`OUT.parquet.parts/part-000000.parquet`, each written under a `.tmp` name and renamed when
complete) and merges them into `OUT.parquet` when the run ends; a crash loses at most the rows
buffered for the next part, which the resumed run redoes.
"""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path
from typing import Any

from inferengine.entrypoints.batch.formats import OUTPUT_COLUMNS, InputFile
from inferengine.entrypoints.batch.resume import recover_csv, recover_jsonl, recover_parquet
from inferengine.errors import ConfigError


class JsonlWriter:
    def __init__(self, path: Path, fmt: str):
        self.done_keys = recover_jsonl(path, fmt)
        self._file = open(path, "ab")  # noqa: SIM115 (closed in close())

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False, default=str) + "\n"
        self._file.write(line.encode("utf-8"))

    def flush(self) -> None:
        self._file.flush()

    def close(self, finished: bool = True) -> None:
        self._file.close()


class CsvWriter:
    def __init__(self, path: Path, input_columns: list[str]):
        _check_reserved(input_columns)
        self.header = [*input_columns, *OUTPUT_COLUMNS]
        self.done_keys = recover_csv(path, self.header)
        new = not path.exists() or path.stat().st_size == 0
        self._file = open(path, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._writer = csv.DictWriter(self._file, self.header, extrasaction="ignore")
        if new:
            self._writer.writeheader()

    def write(self, record: dict[str, Any]) -> None:
        self._writer.writerow({k: _csv_cell(v) for k, v in record.items()})

    def flush(self) -> None:
        self._file.flush()

    def close(self, finished: bool = True) -> None:
        self._file.close()


class ParquetWriter:
    """Rows buffered into parts of `rows_per_part` rows (or whatever `flush_seconds` gathered)."""

    def __init__(self, path: Path, input_schema: Any, rows_per_part: int, flush_seconds: float):
        import pyarrow as pa

        _check_reserved(input_schema.names)
        self.path = path
        self.parts_dir = path.with_name(path.name + ".parts")
        self.schema = pa.schema(
            [
                *input_schema.remove_metadata(),
                pa.field("row_index", pa.int64()),
                pa.field("output_text", pa.string()),
                pa.field("finish_reason", pa.string()),
                pa.field("prompt_tokens", pa.int64()),
                pa.field("completion_tokens", pa.int64()),
                pa.field("error", pa.string()),
            ]
        )
        self.rows_per_part = rows_per_part
        self.flush_seconds = flush_seconds
        self.done_keys = recover_parquet(path, self.parts_dir, self.schema)
        self._buffer: list[dict[str, Any]] = []
        self._last_part = time.monotonic()
        existing = sorted(self.parts_dir.glob("part-*.parquet"))
        self._next_part = int(existing[-1].stem.split("-")[1]) + 1 if existing else 0

    def write(self, record: dict[str, Any]) -> None:
        self._buffer.append(record)
        if len(self._buffer) >= self.rows_per_part:
            self._write_part()

    def flush(self) -> None:
        if self._buffer and time.monotonic() - self._last_part >= self.flush_seconds:
            self._write_part()

    def close(self, finished: bool = True) -> None:
        """Write the last part; when the run `finished`, merge everything into the output."""
        self._write_part()
        if finished:
            self._merge()

    def _write_part(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._last_part = time.monotonic()
        if not self._buffer:
            return
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        name = f"part-{self._next_part:06d}.parquet"
        tmp = self.parts_dir / (name + ".tmp")
        table = pa.Table.from_pylist(self._buffer, schema=self.schema)
        with pq.ParquetWriter(tmp, self.schema) as writer:
            writer.write_table(table)
        tmp.replace(self.parts_dir / name)
        self._next_part += 1
        self._buffer = []

    def _merge(self) -> None:
        """One pass over the old output and the parts, in row groups of about `rows_per_part`."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        parts = sorted(self.parts_dir.glob("part-*.parquet")) if self.parts_dir.exists() else []
        sources = ([self.path] if self.path.exists() else []) + parts
        if not parts and sources:
            return  # nothing new
        tmp = self.path.with_name(self.path.name + ".tmp")
        pending: list[Any] = []
        with pq.ParquetWriter(tmp, self.schema) as writer:
            for source in sources:
                file = pq.ParquetFile(source)
                for group in range(file.num_row_groups):
                    pending.append(file.read_row_group(group).cast(self.schema))
                    if sum(t.num_rows for t in pending) >= self.rows_per_part:
                        writer.write_table(pa.concat_tables(pending))
                        pending = []
            if pending or not sources:
                writer.write_table(
                    pa.concat_tables(pending) if pending else self.schema.empty_table()
                )
        tmp.replace(self.path)
        shutil.rmtree(self.parts_dir, ignore_errors=True)


Writer = JsonlWriter | CsvWriter | ParquetWriter


def open_writer(
    path: Path, source: InputFile, rows_per_part: int = 4096, flush_seconds: float = 30.0
) -> Writer:
    """The writer for the input's format; its `done_keys` are the rows `path` already holds."""
    if path.resolve() == source.path.resolve():
        raise ConfigError("the output file must not be the input file.")
    path.parent.mkdir(parents=True, exist_ok=True)
    if source.format in ("openai", "jsonl"):
        return JsonlWriter(path, source.format)
    if source.format == "csv":
        assert source.columns is not None
        return CsvWriter(path, source.columns)
    return ParquetWriter(path, source.arrow_schema, rows_per_part, flush_seconds)


def _check_reserved(columns: list[str]) -> None:
    clash = [c for c in columns if c in OUTPUT_COLUMNS]
    if clash:
        raise ConfigError(
            f"the input has the column(s) {clash}, which run-batch writes its results into; "
            "rename them."
        )


def _csv_cell(value: Any) -> Any:
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return value
