"""Memory stays flat: a long generated input is never held whole, only a window of rows."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

from inferengine.entrypoints.batch.formats import InputRow
from inferengine.entrypoints.batch.mapping import RowMapper
from inferengine.entrypoints.batch.runner import BatchRunner
from inferengine.entrypoints.batch.writers import JsonlWriter

WINDOW = 16


def _rows(n: int) -> Iterator[InputRow]:
    for i in range(n):
        yield InputRow(i, {"prompt": f"Hello world {i}", "max_tokens": 1, "note": "x" * 200})


def _peak_bytes(batch_llm, tmp_path, n: int) -> tuple[int, int]:
    engine = batch_llm.llm_engine
    writer = JsonlWriter(tmp_path / f"out-{n}.jsonl", "jsonl")
    runner = BatchRunner(engine, RowMapper(engine, "jsonl"), writer, WINDOW)
    tracemalloc.start()
    try:
        summary = runner.run(_rows(n))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        writer.close()
    assert (summary.done, summary.failed) == (n, 0)
    assert summary.max_buffered_rows == WINDOW
    return peak, sum(1 for _ in open(tmp_path / f"out-{n}.jsonl"))


def test_memory_does_not_grow_with_the_input(batch_llm, tmp_path):
    _peak_bytes(batch_llm, tmp_path, 50)  # warm up caches (token strings, torch kernels)
    small, written_small = _peak_bytes(batch_llm, tmp_path, 200)
    large, written_large = _peak_bytes(batch_llm, tmp_path, 2000)
    assert (written_small, written_large) == (200, 2000)
    # Ten times the rows (about 0.5 MB of output records more) in about the same memory.
    assert large < small * 1.5 + 100_000, (small, large)
