"""`bench paired` end to end with fake servers started as commands, and `bench plot` on its folder."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from inferengine.bench.systems import health_ok
from inferengine.entrypoints.cli.main import main

FAKE = Path(__file__).with_name("fake_server.py")


def fake_command(**flags) -> str:
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} --port {{port}} {args}"


WORKLOAD = ["--num-prompts", "12", "--random-input-len", "16", "--random-output-len", "8",
            "--max-concurrency", "4", "--ignore-eos", "--disable-tqdm"]  # fmt: skip


@pytest.fixture(scope="module")
def paired_run(tokenizer_dir, tmp_path_factory):
    """A (fast) and B (15 ms per token) started by `paired`; one gate passes, one fails."""
    out = tmp_path_factory.mktemp("paired")
    a = fake_command(token_delay_ms=1, startup_delay_s=0.6, log_requests=1)
    b = fake_command(token_delay_ms=15, log_requests=1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "pynvml", None)  # NVML absent, also on a GPU machine
        code = main(
            ["bench", "paired", "--system", f"A={a}", "--system", f"B={b}",
             "--tokenizer", str(tokenizer_dir), *WORKLOAD, "--out-dir", str(out),
             "--gate", "output_throughput>=1.5", "--gate", "median_itl_ms<=2@B",
             "--log-lines", "5", "--gpu-interval", "0.05", "--stop-timeout", "5"]
        )  # fmt: skip
    return code, out


def test_paired_writes_every_file(paired_run):
    code, out = paired_run
    assert code == 1  # one gate failed
    names = {p.name for p in out.iterdir()}
    want = {"A.json", "B.json", "A.log", "B.log", "A-gpu.csv", "B-gpu.csv"}
    assert want | {"environment.txt", "comparison.json"} <= names


def test_paired_comparison_and_gates(paired_run):
    _, out = paired_run
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["systems"] == ["A", "B"]
    assert comparison["all_systems_ran"] and not comparison["passed"]
    gates = comparison["gates"]
    assert [g["passed"] for g in gates] == [True, False]
    assert gates[0]["target"] == "A/B" and gates[0]["value"] >= 1.5
    assert gates[1]["target"] == "B" and gates[1]["value"] > 5.0
    thr = comparison["metrics"]["output_throughput"]
    assert thr["ratio"] == pytest.approx(thr["values"]["A"] / thr["values"]["B"])
    itl = comparison["metrics"]["median_itl_ms"]
    assert itl["better"] == "lower" and itl["ratio"] < 1
    runs = comparison["runs"]
    assert runs["A"]["ready_s"] >= 0.6  # /health answers 503 for the first 0.6 s
    assert runs["B"]["ready_s"] > 0
    assert comparison["metrics"]["ready_s"]["values"]["A"] == runs["A"]["ready_s"]
    for run in runs.values():
        assert run["error"] is None
        assert not health_ok(run["base_url"])  # the server was stopped
        assert run["gpu"]["available"] is False  # NVML made unavailable


def test_paired_results_share_the_workload(paired_run):
    _, out = paired_run
    a, b = (json.loads((out / f"{n}.json").read_text()) for n in "AB")
    assert a["completed"] == b["completed"] == 12 and a["failed"] == b["failed"] == 0
    assert a["expected_input_lens"] == b["expected_input_lens"]
    assert a["output_lens"] == b["output_lens"] == a["expected_output_lens"]
    assert (a["label"], b["label"]) == ("A", "B")
    assert b["median_itl_ms"] > a["median_itl_ms"]
    assert {"p99_ttft_ms", "median_tpot_ms", "p99_e2el_ms", "ready_s"} <= a.keys()


def test_paired_logs_trace_and_environment(paired_run):
    _, out = paired_run
    log = (out / "A.log").read_text().splitlines()
    assert log[0].startswith("# [trimmed: the first") and len(log) == 6
    assert log[-1].startswith("request ")
    assert (out / "A-gpu.csv").read_text().startswith("# NVML unavailable")
    env = (out / "environment.txt").read_text()
    for key in ("date_utc:", "gpu: NVML unavailable", "torch:", "python:", "platform:", "git:"):
        assert key in env
    assert "A server: " in env and str(FAKE) in env and "paired: " in env


def test_plot_writes_small_pngs(paired_run):
    _, out = paired_run
    assert main(["bench", "plot", str(out)]) == 0
    for name in ("throughput.png", "ttft_cdf.png", "itl_cdf.png"):
        png = out / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png.stat().st_size < 150_000
    assert not (out / "gpu_util.png").exists()  # no GPU samples to draw


def test_paired_with_running_servers_and_a_failed_launch(fake_server, tokenizer_dir, tmp_path):
    fast, slow = fake_server(token_delay_ms=0), fake_server(token_delay_ms=8)
    crash = f"{shlex.quote(sys.executable)} -c 'raise SystemExit(3)' --port {{port}}"
    code = main(
        ["bench", "paired", "--system", f"fast=url:{fast.base_url}",
         "--system", f"slow=url:{slow.base_url}", "--tokenizer", str(tokenizer_dir),
         *WORKLOAD, "--out-dir", str(tmp_path / "ok"), "--gate", "output_throughput>1"]
    )  # fmt: skip
    assert code == 0
    comparison = json.loads((tmp_path / "ok" / "comparison.json").read_text())
    assert comparison["passed"] and comparison["runs"]["fast"]["ready_s"] is None
    assert "already running" in (tmp_path / "ok" / "fast.log").read_text()

    code = main(
        ["bench", "paired", "--system", f"fast=url:{fast.base_url}", "--system", f"bad={crash}",
         "--tokenizer", str(tokenizer_dir), *WORKLOAD, "--out-dir", str(tmp_path / "bad")]
    )  # fmt: skip
    assert code == 1  # no gates, but a system did not run
    comparison = json.loads((tmp_path / "bad" / "comparison.json").read_text())
    assert "exited with code 3" in comparison["runs"]["bad"]["error"]
    assert comparison["runs"]["fast"]["error"] is None
    assert (tmp_path / "bad" / "fast.json").exists() and (tmp_path / "bad" / "bad-gpu.csv").exists()
