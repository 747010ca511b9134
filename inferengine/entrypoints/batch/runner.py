"""The batch loop: rows read lazily, a bounded window of them in the engine, results written as they finish.

At most `max_in_flight` rows are held at once (in the engine, or finished and waiting for their
turn with `ordered`), so memory stays flat however long the file is. Results are written in
completion order unless `ordered`; either way each carries its row's identity (`custom_id`, or
`row_index`). Rows the output already holds are skipped, which makes a rerun a resume.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from inferengine.engine.llm_engine import LLMEngine
from inferengine.entrypoints.batch.formats import (
    InputRow,
    check_output_path,
    detect_format,
    open_input,
)
from inferengine.entrypoints.batch.mapping import Job, RowMapper
from inferengine.entrypoints.batch.writers import Writer, open_writer
from inferengine.entrypoints.openai.errors import log_internal_error
from inferengine.errors import ConfigError, InferEngineError
from inferengine.logger import init_logger

logger = init_logger(__name__)

ROWS_IN_FLIGHT_PER_SEQ = 4  # default window: this many rows per engine sequence slot
_MAX_LOGGED_INTERNAL_ERRORS = 3


@dataclass
class BatchConfig:
    input_path: str
    output_path: str
    input_format: str | None = None  # openai, jsonl, csv or parquet; None: from the extension
    max_in_flight: int | None = None  # rows held at once; None: 4 × max_num_seqs
    ordered: bool = False  # write results in input order (else in completion order)
    quiet: bool = False  # no progress bar
    defaults: dict[str, Any] | None = None  # request fields for plain rows that lack them
    parquet_rows_per_part: int = 4096
    flush_seconds: float = 30.0  # a Parquet part is written at least this often


@dataclass
class BatchSummary:
    done: int = 0  # rows with a result, this run
    failed: int = 0  # rows with an error record, this run
    skipped: int = 0  # rows the output already held
    output_tokens: int = 0
    seconds: float = 0.0
    max_buffered_rows: int = 0  # most rows held at once

    def describe(self) -> str:
        rate = self.output_tokens / self.seconds if self.seconds > 0 else 0.0
        rows = self.done + self.failed
        return (
            f"run-batch: {self.done} done, {self.failed} failed, {self.skipped} skipped; "
            f"{rows} rows and {self.output_tokens} output tokens in {self.seconds:.1f} s "
            f"({rows / max(self.seconds, 1e-9):.2f} rows/s, {rate:.1f} output tok/s)"
        )


def check_paths(config: BatchConfig) -> str:
    """The input format, after checking the paths (cheap: before a model is loaded)."""
    if not Path(config.input_path).is_file():
        raise ConfigError(f"input file {config.input_path} does not exist.")
    fmt = detect_format(Path(config.input_path), config.input_format)
    check_output_path(Path(config.output_path), fmt)
    return fmt


def run_batch(engine: LLMEngine, config: BatchConfig) -> BatchSummary:
    """Run every row of `config.input_path` not yet in `config.output_path` through `engine`."""
    fmt = check_paths(config)
    source = open_input(Path(config.input_path), fmt)
    mapper = RowMapper(engine, fmt, config.defaults)
    writer = open_writer(
        Path(config.output_path), source, config.parquet_rows_per_part, config.flush_seconds
    )
    if writer.done_keys:
        logger.info(
            "resuming: %s already holds %d rows; skipping them.",
            config.output_path,
            len(writer.done_keys),
        )
    window = config.max_in_flight or (
        ROWS_IN_FLIGHT_PER_SEQ * engine.config.scheduler_config.max_num_seqs
    )
    bar = None if config.quiet else _progress_bar(source.total)
    runner = BatchRunner(engine, mapper, writer, window, config.ordered, bar)
    finished = False
    try:
        summary = runner.run(source.rows)
        finished = True
    finally:
        writer.close(finished=finished)
        if bar is not None:
            bar.close()
    return summary


class BatchRunner:
    def __init__(
        self,
        engine: LLMEngine,
        mapper: RowMapper,
        writer: Writer,
        max_in_flight: int,
        ordered: bool = False,
        bar: Any = None,
    ):
        self.engine = engine
        self.mapper = mapper
        self.writer = writer
        self.max_in_flight = max(1, max_in_flight)
        self.ordered = ordered
        self.bar = bar
        self.summary = BatchSummary()
        self._done_keys = writer.done_keys
        self._requests: dict[str, tuple[Job, int]] = {}  # engine request id -> (job, prompt)
        self._held = 0  # rows taken from the input and not yet written
        self._order: deque[int] = deque()  # with `ordered`: held rows, in input order
        self._ready: dict[int, tuple[dict[str, Any], bool]] = {}
        self._internal_errors = 0

    def run(self, rows: Iterable[InputRow]) -> BatchSummary:
        rows = iter(rows)
        start = time.perf_counter()
        exhausted = False
        try:
            while True:
                if not exhausted:
                    exhausted = self._fill(rows)
                if not self._requests:
                    assert exhausted and not self._held, "rows held with nothing in the engine"
                    break
                self._step()
                self.writer.flush()
                self._show_rate(start)
        except BaseException:
            self.engine.abort_request(list(self._requests))
            raise
        finally:
            self.summary.seconds = time.perf_counter() - start
        return self.summary

    # ---- rows in -----------------------------------------------------------------------------

    def _fill(self, rows: Iterator[InputRow]) -> bool:
        """Take rows until the window is full; True when the input is exhausted."""
        while self._held < self.max_in_flight:
            row = next(rows, None)
            if row is None:
                return True
            if self._done_keys and self.mapper.key(row) in self._done_keys:
                self.summary.skipped += 1
                if self.bar is not None and self.bar.total:
                    self.bar.total -= 1
                continue
            self._held += 1
            self.summary.max_buffered_rows = max(self.summary.max_buffered_rows, self._held)
            if self.ordered:
                self._order.append(row.index)
            try:
                self._submit(self.mapper.prepare(row))
            except Exception as e:
                self._log_internal(e)
                self._finish(row.index, self.mapper.failure(row, e), ok=False)
        return False

    def _submit(self, job: Job) -> None:
        added: list[str] = []
        inputs = job.engine_inputs()
        try:
            for i, (prompt, params) in enumerate(zip(inputs, job.params, strict=True)):
                request_id = f"batch-{job.row.index}" + (f"-{i}" if len(inputs) > 1 else "")
                self.engine.add_request(
                    request_id,
                    prompt,
                    params,
                    priority=job.req.priority,
                    cache_salt=getattr(job.req, "cache_salt", None),
                    retention=job.retention,
                    pooling_params=job.pooling,
                )
                added.append(request_id)
                self._requests[request_id] = (job, i)
        except BaseException:
            if added:
                self.engine.abort_request(added)
                for request_id in added:
                    del self._requests[request_id]
            raise
        job.remaining = len(added)

    # ---- results out -------------------------------------------------------------------------

    def _step(self) -> None:
        for output in self.engine.step():
            if not output.finished:
                continue
            entry = self._requests.pop(output.request_id, None)
            if entry is None:
                continue
            job, i = entry
            job.finals[i] = output
            job.remaining -= 1
            if job.pooling is None:  # a pooling request's one token is dropped
                self.summary.output_tokens += sum(len(c.token_ids) for c in output.outputs)
            if job.remaining:
                continue
            try:
                record, ok = self.mapper.success(job), True
            except Exception as e:
                self._log_internal(e)
                record, ok = self.mapper.failure(job.row, e), False
            self._finish(job.row.index, record, ok)

    def _finish(self, index: int, record: dict[str, Any], ok: bool) -> None:
        if not self.ordered:
            self._write(record, ok)
            return
        self._ready[index] = (record, ok)
        while self._order and self._order[0] in self._ready:
            self._write(*self._ready.pop(self._order.popleft()))

    def _write(self, record: dict[str, Any], ok: bool) -> None:
        self.writer.write(record)
        self._held -= 1
        if ok:
            self.summary.done += 1
        else:
            self.summary.failed += 1
        if self.bar is not None:
            self.bar.update(1)

    def _show_rate(self, start: float) -> None:
        if self.bar is not None:
            rate = self.summary.output_tokens / max(time.perf_counter() - start, 1e-9)
            self.bar.set_postfix_str(f"{rate:.1f} output tok/s", refresh=False)

    def _log_internal(self, e: Exception) -> None:
        """A row that failed for a reason other than a bad request is a bug worth a traceback."""
        if isinstance(e, InferEngineError | ValidationError):
            return
        self._internal_errors += 1
        if self._internal_errors <= _MAX_LOGGED_INTERNAL_ERRORS:
            log_internal_error("in a row", e)


def _progress_bar(total: int | None) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="run-batch", unit="row", dynamic_ncols=True, mininterval=0.5)
