"""Result-folder compaction: exactly which fields, lines and files go, and what stays."""

from __future__ import annotations

import gzip
import json
import random
import statistics
import string
from pathlib import Path

from inferengine.bench.compact import (
    FOLDER_BUDGET_BYTES,
    NOTE,
    compact_folder,
    compact_result,
    folder_bytes,
    summarise_gpu_csv,
    trim_log,
)
from tests.conftest import load_script

SUMMARY = {
    "completed": 200,
    "failed": 0,
    "request_rate": "inf",
    "request_goodput": None,
    "output_throughput": 2107.5424262433175,
    "median_ttft_ms": 26.610419500002536,
    "p99_ttft_ms": 141.034364329997,
    "median_itl_ms": 5.835691499996187,
    "extra_body": {},
    "percentiles": [50, 99],
}
OUR_ARRAYS = [
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "start_times",
    "generated_texts",
    "errors",
    "latencies",
    "expected_input_lens",
    "expected_output_lens",
]


def serve_result(n: int = 200, arrays: list[str] = OUR_ARRAYS) -> dict:
    rng = random.Random(0)  # random weights' text: it does not compress
    per_request = {
        "input_lens": [256] * n,
        "output_lens": [64] * n,
        "ttfts": [0.025 + i / 1e5 for i in range(n)],
        "itls": [[0.005] * 63 for _ in range(n)],
        "start_times": [i / 100 for i in range(n)],
        "generated_texts": ["".join(rng.choices(string.ascii_letters, k=50)) for _ in range(n)],
        "errors": [""] * n,
        "latencies": [0.4] * n,
        "expected_input_lens": [256] * n,
        "expected_output_lens": [64] * n,
    }
    return {**SUMMARY, **{k: per_request[k] for k in arrays}}


def test_serve_result_keeps_every_summary_field_and_names_what_went():
    original = serve_result()
    out = compact_result(original)
    assert out == {**SUMMARY, "compacted": {"dropped": OUR_ARRAYS, "note": NOTE}}
    assert list(original) == [*SUMMARY, *OUR_ARRAYS]  # the input is not modified
    assert compact_result(out) is out  # nothing left to drop


def test_vllm_result_and_a_short_run_lose_their_per_request_fields_too():
    vllm_arrays = OUR_ARRAYS[:7]  # vLLM's bench serve has no latencies or expected_*
    out = compact_result(serve_result(n=8, arrays=vllm_arrays))
    assert out["compacted"]["dropped"] == vllm_arrays
    assert set(out) == {*SUMMARY, "compacted"}


def test_nested_results_summarise_long_numbers_and_drop_long_text():
    result = {
        "model": "tiny",
        "prompt_lengths": list(range(100)),
        "texts": ["generated"] * 65,
        "token_ids": [[1, 2, 3]] * 80,
        "short": list(range(64)),
        "rows": [{"m": i, "us": 2.0 * i} for i in range(70)],
        "runs": [{"ttfts": [0.1] * 3, "median_ttft_ms": 100.0, "errors": ["", ""]}],
        "check": {"errors": ["kept: not a serve result"], "steps": [0.5] * 65},
    }
    out = compact_result(result)
    assert out["prompt_lengths"] == {"n": 100, "min": 0, "median": 49.5, "max": 99}
    assert out["check"] == {
        "errors": ["kept: not a serve result"],
        "steps": {"n": 65, "min": 0.5, "median": 0.5, "max": 0.5},
    }
    assert out["short"] == list(range(64))
    assert out["rows"] == result["rows"]
    assert out["runs"] == [{"median_ttft_ms": 100.0}]
    assert out["compacted"] == {
        "dropped": ["texts", "token_ids", "runs[].ttfts", "runs[].errors"],
        "summarised": ["prompt_lengths", "check.steps"],
        "note": NOTE,
    }


def test_result_with_nothing_to_drop_is_returned_as_is():
    result = {"systems": ["a", "b"], "metrics": {"x": {"values": {"a": 1.0}}}}
    assert compact_result(result) is result


def test_trim_log_keeps_head_and_tail_and_cuts_long_lines(tmp_path):
    log = tmp_path / "server.log"
    lines = [f"line {i}" for i in range(300)]
    lines[0] = "x" * 1000
    lines[299] = "\r".join(f"Capturing: {pct:3d}%|" for pct in range(0, 101, 10)) + "\r"
    log.write_text("\n".join(lines) + "\n")
    note = trim_log(log, head=3, tail=2, max_line_chars=100)
    assert note == "kept the first 3 and last 2 lines, dropped 295; cut 2 lines to 100 characters"
    assert log.read_text().split("\n") == [
        "x" * 70 + " [... 930 chars cut]",
        "line 1",
        "line 2",
        "[... 295 lines dropped ...]",
        "line 298",
        "Capturing:   0%| [...] Capturing: 100%|",
        "",
    ]
    trimmed = log.read_bytes()
    assert trim_log(log, head=3, tail=2, max_line_chars=100) is None
    assert log.read_bytes() == trimmed


def test_trim_log_keeps_matching_lines_from_the_middle(tmp_path):
    log = tmp_path / "vllm.log"
    lines = [f"step {i}" for i in range(100)]
    lines[50] = "Avg generation throughput: 7025.7 tokens/s, Running: 243 reqs"
    log.write_text("\n".join(lines) + "\n")
    assert trim_log(log, head=2, tail=2, keep="throughput") is not None
    assert log.read_text().split("\n") == [
        "step 0",
        "step 1",
        "[... 95 lines dropped, 1 matching 'throughput' kept ...]",
        lines[50],
        "step 98",
        "step 99",
        "",
    ]
    trimmed = log.read_bytes()
    assert trim_log(log, head=2, tail=2, keep="throughput") is None
    assert log.read_bytes() == trimmed


def test_trim_log_leaves_a_short_log_alone(tmp_path):
    log = tmp_path / "client.log"
    log.write_text("a\nb\nc")
    assert trim_log(log) is None
    assert log.read_text() == "a\nb\nc"


GPU_CSV = """t_s,phase,gpu,util_pct,mem_util_pct,mem_used_mib,mem_total_mib,power_w
0.0,startup,0,0,0,1000.0,81559.0,90.0
0.2,startup,0,10,5,2000.0,81559.0,110.0
0.4,benchmark,0,90,60,65000.5,81559.0,
0.6,benchmark,0,100,70,65100.5,81559.0,
0.8,benchmark,0,95,65,65050.0,81559.0,
"""


def test_summarise_gpu_csv_per_phase(tmp_path):
    path = tmp_path / "inferengine-gpu.csv"
    path.write_text(GPU_CSV)
    summary = summarise_gpu_csv(path)
    assert summary["source"] == "inferengine-gpu.csv"
    assert summary["unavailable"] is None
    common = {"gpu": 0, "mem_total_mib": 81559.0}
    assert summary["phases"] == [
        {
            **common,
            "phase": "startup",
            "seconds": 0.2,
            "samples": 2,
            "busy_pct": 5.0,
            "mem_util_pct": 2.5,
            "peak_mem_used_mib": 2000.0,
            "mean_power_w": 100.0,
        },
        {
            **common,
            "phase": "benchmark",
            "seconds": 0.4,
            "samples": 3,
            "busy_pct": 95.0,
            "mem_util_pct": 65.0,
            "peak_mem_used_mib": 65100.5,
            "mean_power_w": None,
        },
    ]


def test_summarise_gpu_csv_without_nvml(tmp_path):
    path = tmp_path / "vllm-gpu.csv"
    path.write_text("# NVML unavailable: ImportError: no pynvml\n" + GPU_CSV.splitlines()[0])
    summary = summarise_gpu_csv(path)
    assert summary["unavailable"] == "NVML unavailable: ImportError: no pynvml"
    assert summary["phases"] == []


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite tests="{n}" failures="1"
errors="0" skipped="1" time="12.5">{cases}
<testcase classname="t.m" name="test_bad" time="0.5"><failure message="assert 1 == 2"/></testcase>
<testcase classname="t.m" name="test_skip" time="0"><skipped message="needs two GPUs"/></testcase>
<testcase classname="t.m" name="test_prop" time="1.0"><properties>
<property name="near_ties" value="3"/></properties></testcase></testsuite></testsuites>
"""


SMALL_FILES = ("environment.txt", "small.json", "vllm-gpu.csv")


def make_folder(folder: Path) -> dict[str, bytes]:
    """A paired-run folder with every kind of file compact_folder knows, each over 16 kB."""
    folder.mkdir()
    comparison = {"metrics": {"output_throughput": {"ratio": 1.17}}, "pad": "x" * 20_000}
    (folder / "comparison.json").write_text(json.dumps(comparison))
    (folder / "environment.txt").write_text("gpu 0: H100\n")
    (folder / "small.json").write_text(json.dumps(serve_result(n=2)))
    (folder / "inferengine.json").write_text(json.dumps(serve_result(), indent=1))
    vllm = json.dumps(serve_result(n=1000)).encode()
    (folder / "vllm.json.gz").write_bytes(gzip.compress(vllm))
    (folder / "vllm.log").write_text("".join(f"INFO request {i} done\n" for i in range(2000)))
    benchmark_rows = "".join(GPU_CSV.splitlines(keepends=True)[3:])
    (folder / "inferengine-gpu.csv").write_text(GPU_CSV + benchmark_rows * 400)
    (folder / "vllm-gpu.csv").write_text(GPU_CSV)  # small, but summarised with its peer
    events = [{"cat": "kernel", "name": "gemm", "dur": 10.0}] * 3000
    events += [{"cat": "cpu_op", "name": "aten::mm", "dur": 50.0}] * 10
    events += [{"cat": "gpu_memcpy", "name": "Memcpy HtoD", "dur": 2.5}] * 4
    trace = {"traceEvents": events, "pad": [str(i) for i in range(20_000)]}
    (folder / "trace.json.gz").write_bytes(gzip.compress(json.dumps(trace).encode()))
    cases = "".join(f'<testcase classname="t.m" name="test_{i}" time="0.01"/>' for i in range(400))
    (folder / "gpu-tests.xml").write_text(JUNIT.format(n=403, cases=cases))
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert all(len(files[f]) > 16_000 for f in files if f not in SMALL_FILES)
    return files


def test_compact_folder(tmp_path):
    folder = tmp_path / "20261122T144347Z-w1-paired"
    before = make_folder(folder)
    report = compact_folder(folder)
    after = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert sorted(after) == [
        "COMPACTED.txt",
        "comparison.json",
        "environment.txt",
        "gpu-tests-summary.json",
        "inferengine-gpu-summary.json",
        "inferengine.json",
        "small.json",
        "trace-top-kernels.json",
        "vllm-gpu-summary.json",
        "vllm.json",
        "vllm.log",
    ]
    for kept in ("comparison.json", "environment.txt", "small.json"):
        assert after[kept] == before[kept]
    assert report["bytes_before"] == sum(map(len, before.values()))
    assert report["bytes_after"] == folder_bytes(folder) < 20_000 + 12_000
    assert len(report["actions"]) == 7

    for name in ("inferengine.json", "vllm.json"):
        assert json.loads(after[name]) == {
            **SUMMARY,
            "compacted": {"dropped": OUR_ARRAYS, "note": NOTE},
        }
    log = after["vllm.log"].decode().split("\n")
    assert log[39:42] == [
        "INFO request 39 done",
        "[... 1840 lines dropped ...]",
        "INFO request 1880 done",
    ]
    gpu = json.loads(after["inferengine-gpu-summary.json"])
    assert [(p["phase"], p["samples"]) for p in gpu["phases"]] == [
        ("startup", 2),
        ("benchmark", 1203),
    ]
    assert json.loads(after["trace-top-kernels.json"])["top_kernels"] == [
        {"name": "gemm", "calls": 3000, "total_ms": 30.0},
        {"name": "Memcpy HtoD", "calls": 4, "total_ms": 0.01},
    ]
    junit = json.loads(after["gpu-tests-summary.json"])
    assert junit["totals"] == {
        "tests": 403,
        "failures": 1,
        "errors": 0,
        "skipped": 1,
        "passed": 401,
        "time_s": 12.5,
    }
    assert junit["failed"] == [{"test": "t.m::test_bad", "failure": "assert 1 == 2"}]
    assert junit["skip_reasons"] == {"needs two GPUs": 1}
    assert junit["properties"] == {"t.m::test_prop": {"near_ties": "3"}}
    note = after["COMPACTED.txt"].decode()
    assert "git history holds the original" in note
    for line in (
        "- vllm.json.gz: dropped " + ", ".join(OUR_ARRAYS) + "; now plain vllm.json",
        "- vllm.log: kept the first 40 and last 120 lines, dropped 1840",
        "- inferengine-gpu.csv: replaced by inferengine-gpu-summary.json",
        "- vllm-gpu.csv: replaced by vllm-gpu-summary.json",
        "- trace.json.gz: replaced by trace-top-kernels.json",
        "- gpu-tests.xml: replaced by gpu-tests-summary.json",
    ):
        assert line in note

    again = compact_folder(folder)
    assert again["actions"] == []
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == after


def test_compact_folder_leaves_a_small_folder_alone(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({"ttfts": [0.1] * 100}))
    report = compact_folder(folder)
    assert report["actions"] == []
    assert sorted(p.name for p in folder.iterdir()) == ["results.json"]


def test_write_result_folder_compacts_an_oversized_folder(tmp_path, capsys):
    module = load_script("benchmarks/result_folder.py")
    steps = [5.0 + i / 1e4 for i in range(30_000)]
    results = {"median_step_ms": 5.2, "step_ms_all": steps}
    folder = module.write_result_folder("decode-profile", results, tmp_path / "out")
    assert folder_bytes(folder) <= FOLDER_BUDGET_BYTES
    written = json.loads((folder / "results.json").read_text())
    assert written["median_step_ms"] == 5.2
    median = statistics.median(steps)
    assert written["step_ms_all"] == {"n": 30_000, "min": 5.0, "median": median, "max": steps[-1]}
    assert "  results.json: summarised step_ms_all\n" in capsys.readouterr().out
