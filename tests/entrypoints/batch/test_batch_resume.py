"""Rerunning resumes: a killed run, then a rerun, gives exactly one result per row, none lost."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from inferengine.entrypoints.batch.resume import recover_csv, recover_jsonl
from inferengine.errors import ConfigError
from tests.entrypoints.batch.helpers import (
    MAX_MODEL_LEN,
    openai_line,
    read_jsonl,
    run,
    write_jsonl,
)

ROW = {"prompt": "Hello world", "max_tokens": 4, "temperature": 0}
SLOW_ROW = {"prompt": "The quick brown fox", "max_tokens": 24, "ignore_eos": True}


def _cli(model: Path, inp: Path, out: Path, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "inferengine.entrypoints.cli.main",
        "run-batch",
        "-i",
        str(inp),
        "-o",
        str(out),
        "--model",
        str(model),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        "2",
        "--max-in-flight",
        "4",
        "--kv-cache-memory",
        "8MiB",
        "--quiet",
        *flags,
    ]


def _kill_when(proc: subprocess.Popen, ready, timeout: float = 120.0) -> None:
    """SIGKILL `proc` as soon as `ready()`; fails if it finished first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before it could be killed; make it longer"
        assert time.monotonic() < deadline, "no output appeared"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _count_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


def test_killed_jsonl_run_resumes(tiny_checkpoint, tmp_path):
    n = 150
    inp = write_jsonl(tmp_path / "in.jsonl", [openai_line(f"r{i}", SLOW_ROW) for i in range(n)])
    out = tmp_path / "out.jsonl"
    model = tiny_checkpoint("qwen3")
    proc = subprocess.Popen(_cli(model, inp, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _kill_when(proc, lambda: _count_lines(out) >= 8)
    written = _count_lines(out)
    assert 8 <= written < n
    with open(out, "ab") as f:  # as if the kill had landed mid-write
        f.write(b'{"id": "batch_req_x", "custom_id": "r')
    # Resume with a wider batch (later flags win): the rows' results do not depend on it.
    resume = _cli(model, inp, out, "--max-num-seqs", "16", "--max-in-flight", "64")
    done = subprocess.run(resume, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "half-written record" in done.stderr
    assert f"{n - written} done, 0 failed, {written} skipped" in done.stdout
    records = read_jsonl(out)
    assert sorted(r["custom_id"] for r in records) == sorted(f"r{i}" for i in range(n))
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 24 for r in records)


def test_killed_parquet_run_resumes(batch_llm, tiny_checkpoint, tmp_path):
    n = 60
    rows = [{"key": f"k{i}", **SLOW_ROW} for i in range(n)]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    out = tmp_path / "out.parquet"
    parts = tmp_path / "out.parquet.parts"
    flags = ("--parquet-rows-per-part", "3")
    proc = subprocess.Popen(
        _cli(tiny_checkpoint("qwen3"), inp, out, *flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _kill_when(proc, lambda: len(list(parts.glob("part-*.parquet"))) >= 2)
    assert not out.exists()
    kept = sum(pq.read_metadata(p).num_rows for p in parts.glob("part-*.parquet"))
    # Resume in this process (the same engine code; saves a second model load).
    summary = run(batch_llm, inp, out, parquet_rows_per_part=3)
    assert (summary.done, summary.skipped) == (n - kept, kept)
    assert not parts.exists()
    table = pq.read_table(out).to_pylist()
    assert sorted(r["key"] for r in table) == sorted(r["key"] for r in rows)
    assert sorted(r["row_index"] for r in table) == list(range(n))


def test_parquet_part_left_after_merge_is_dropped(batch_llm, tmp_path):
    rows = [{"prompt": f"Hello {i}", "max_tokens": 2} for i in range(5)]
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), inp)
    out = tmp_path / "out.parquet"
    run(batch_llm, inp, out, parquet_rows_per_part=2)
    # A crash between the merge and the clean-up leaves a part whose rows the output holds.
    parts = tmp_path / "out.parquet.parts"
    parts.mkdir()
    shutil.copy(out, parts / "part-000000.parquet")
    (parts / "part-000001.parquet.tmp").write_bytes(b"half")
    summary = run(batch_llm, inp, out)
    assert (summary.done, summary.skipped) == (0, 5)
    assert sorted(r["row_index"] for r in pq.read_table(out).to_pylist()) == list(range(5))


def test_partial_last_line_is_redone_in_process(batch_llm, tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{**ROW, "custom_id": f"c{i}"} for i in range(6)])
    out = tmp_path / "out.jsonl"
    run(batch_llm, inp, out)
    data = out.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    out.write_bytes(data[: last_start + 20])  # cut the last record in half
    summary = run(batch_llm, inp, out)
    assert (summary.done, summary.skipped) == (1, 5)
    assert sorted(r["custom_id"] for r in read_jsonl(out)) == [f"c{i}" for i in range(6)]


def test_corrupt_line_before_the_end_stops_the_run(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a", "row_index": 0}\nnot json\n{"custom_id": "b"}\n')
    with pytest.raises(ConfigError, match="line 2"):
        recover_jsonl(out, "jsonl")
    out.write_text('{"custom_id": "a", "row_index": 0}\nnot json\n')
    assert recover_jsonl(out, "jsonl") == {"c:a"}
    assert out.read_text() == '{"custom_id": "a", "row_index": 0}\n'


def test_csv_record_cut_inside_a_multiline_cell_is_redone(tmp_path):
    header = ["prompt", "row_index", "output_text"]
    complete = 'prompt,row_index,output_text\r\nhi,0,"two\nlines"\r\n'
    out = tmp_path / "out.csv"
    for tail in ('hi,1,"first line\n', "hi,1,fir", 'hi,1,"x"\r'):
        out.write_text(complete + tail, newline="")
        assert recover_csv(out, header) == {"r:0"}
        assert out.read_bytes() == complete.encode()
    out.write_text(complete + "hi,1\r\nhi,2,x\r\n", newline="")
    with pytest.raises(ConfigError, match="record 2"):
        recover_csv(out, header)
    with pytest.raises(ConfigError, match="columns"):
        recover_csv(out, ["other", *header])


def test_csv_run_resumes(batch_llm, tmp_path):
    inp = tmp_path / "in.csv"
    inp.write_text("prompt,max_tokens\n" + "".join(f"Hello {i},3\n" for i in range(6)))
    out = tmp_path / "out.csv"
    run(batch_llm, inp, out)
    data = out.read_bytes()
    out.write_bytes(data[: len(data) - 7])
    summary = run(batch_llm, inp, out)
    assert (summary.done, summary.skipped) == (1, 5)
    lines = out.read_text().splitlines()
    assert len(lines) == 7 and len({line.split(",")[2] for line in lines[1:]}) == 6
