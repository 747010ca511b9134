"""`bench paired` end to end with fake servers started as commands: rounds in alternating order,
every run kept with medians and ranges, a vLLM-shaped judge, lean folders, and `bench plot`."""

from __future__ import annotations

import json
import shlex
import statistics
import sys
import textwrap
from pathlib import Path

import pytest

from inferengine.bench.compact import FOLDER_BUDGET_BYTES
from inferengine.bench.systems import health_ok
from inferengine.entrypoints.cli.main import main

FAKE = Path(__file__).with_name("fake_server.py")


def fake_command(**flags) -> str:
    args = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in flags.items())
    return f"{shlex.quote(sys.executable)} {shlex.quote(str(FAKE))} --port {{port}} {args}"


WORKLOAD = ["--num-prompts", "12", "--random-input-len", "16", "--random-output-len", "8",
            "--max-concurrency", "4", "--ignore-eos", "--disable-tqdm"]  # fmt: skip


def paired(out: Path, systems: list[str], tokenizer_dir: Path, *extra: str) -> int:
    argv = ["bench", "paired"]
    for s in systems:
        argv += ["--system", s]
    argv += ["--tokenizer", str(tokenizer_dir), "--out-dir", str(out), "--gpu-interval", "0.05"]
    argv += ["--stop-timeout", "5", *extra]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "pynvml", None)  # NVML absent, also on a GPU machine
        return main(argv)


@pytest.fixture(scope="module")
def paired_run(tokenizer_dir, tmp_path_factory):
    """A (fast) and B (15 ms per token), two rounds, our client as judge; one gate fails."""
    out = tmp_path_factory.mktemp("paired")
    a = fake_command(token_delay_ms=1, startup_delay_s=0.6, log_requests=1, spec_counters=1)
    b = fake_command(token_delay_ms=15, log_requests=1)
    code = paired(
        out, [f"A={a}", f"B={b}"], tokenizer_dir, *WORKLOAD, "--repeats", "2", "--judge", "ours",
        "--gate", "output_throughput>=1.5", "--gate", "custom:median_itl_ms<=2@B",
    )  # fmt: skip
    return code, out, json.loads((out / "summary.json").read_text())


def test_rounds_alternate_and_every_run_is_kept(paired_run):
    code, _, summary = paired_run
    assert code == 1  # one gate failed
    assert summary["rounds"] == {"0": ["A", "B"], "1": ["B", "A"]}
    assert summary["judge"] == "inferengine bench serve" and summary["runs_per_system"] == 2
    launches = summary["launches"]
    assert [(x["repeat"], x["system"]) for x in launches] == [
        (0, "A"),
        (0, "B"),
        (1, "B"),
        (1, "A"),
    ]
    for x in launches:
        assert x["error"] is None and x["ready_s"] > 0
        assert not health_ok(x["base_url"])  # stopped
        assert x["gpu"] == {"traced": False}  # no sampler beside the judge
        assert x["mode"] == "paired" and x["warmup"]["completed"] == 48  # the launch warm-up
        assert x["killed_after_sigterm"] == []
    assert min(x["ready_s"] for x in launches if x["system"] == "A") >= 0.6
    w = summary["workloads"]["custom"]
    for name in "AB":
        runs = w["systems"][name]["runs"]
        assert sorted(r["repeat"] for r in runs) == [0, 1]
        thr = [r["metrics"]["output_throughput"] for r in runs]
        spread = w["systems"][name]["spread"]["output_throughput"]
        assert spread == {
            "median": statistics.median(thr), "min": min(thr), "max": max(thr), "n": 2
        }  # fmt: skip
        assert all(r["metrics"]["completed"] == 12 and r["metrics"]["failed"] == 0 for r in runs)
    med = {n: w["systems"][n]["spread"]["median_itl_ms"]["median"] for n in "AB"}
    assert (
        w["ratios"]["median_itl_ms"] == pytest.approx(med["A"] / med["B"]) and med["A"] < med["B"]
    )
    ready = summary["ready_s"]["A"]
    assert ready["runs"] == [x["ready_s"] for x in launches if x["system"] == "A"]


def test_speculation_counters_and_output_lengths_are_recorded_per_run(paired_run):
    _, _, summary = paired_run
    w = summary["workloads"]["custom"]
    for run in w["systems"]["A"]["runs"]:  # 12 requests: 36 drafts, 72 tokens, 48 accepted
        assert run["speculation"] == {
            "drafts": 36, "draft_tokens": 72, "accepted_tokens": 48,
            "acceptance_rate": pytest.approx(2 / 3), "mean_accepted_length": pytest.approx(7 / 3),
        }  # fmt: skip
    assert all(run["speculation"] is None for run in w["systems"]["B"]["runs"])
    assert w["same_output_lens"] == {"A": [True, True], "B": [True, True]}  # --ignore-eos


def test_gates_use_the_medians(paired_run):
    _, _, summary = paired_run
    gates = summary["workloads"]["custom"]["gates"]
    assert [g["passed"] for g in gates] == [True, False]
    assert gates[0]["target"] == "A/B" and gates[0]["value"] >= 1.5
    itl_b = summary["workloads"]["custom"]["systems"]["B"]["spread"]["median_itl_ms"]["median"]
    assert gates[1]["target"] == "B" and gates[1]["value"] == itl_b
    assert summary["errors"] == [] and summary["passed"] is False


def test_folder_is_lean(paired_run):
    _, out, _ = paired_run
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    runs = {f"runs/custom/r{k}-{n}.json" for k in (0, 1) for n in "AB"}
    logs = {f"logs/r{k}-{n}.log" for k in (0, 1) for n in "AB"}
    assert runs | logs | {"summary.json", "environment.txt", "runs.png"} <= files
    result = json.loads((out / "runs/custom/r0-A.json").read_text())
    assert "ttfts" not in result and "itls" not in result and "output_lens" not in result
    assert result["completed"] == 12 and "ttfts" in result["compacted"]["dropped"]
    assert sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) < FOLDER_BUDGET_BYTES
    env = (out / "environment.txt").read_text()
    assert "r0 A server: " in env and "r1 B server: " in env and "paired: " in env


def test_plot_draws_every_run(paired_run):
    _, out, _ = paired_run
    assert main(["bench", "plot", str(out)]) == 0
    png = out / "runs.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 60_000


def fake_vllm(root: Path) -> Path:
    """A `vllm` package whose `bench serve` forwards to ours (vLLM's flags minus --backend)."""
    pkg = root / "vllm" / "entrypoints" / "cli"
    pkg.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "main.py").write_text(
        textwrap.dedent(
            """
            import sys
            from inferengine.entrypoints.cli.main import main
            argv = sys.argv[1:]
            i = argv.index("--backend")
            del argv[i : i + 2]
            with open(argv[argv.index("--result-dir") + 1] + "/argv.txt", "a") as f:
                f.write(" ".join(argv) + "\\n")
            sys.exit(main(argv))
            """
        )
    )
    return root


def test_vllm_judge_with_our_client_beside(fake_server, tokenizer_dir, tmp_path):
    site = fake_vllm(tmp_path / "site")
    server = fake_server(token_delay_ms=1)
    out = tmp_path / "out"
    code = paired(
        out, [f"S=url:{server.base_url}"], tokenizer_dir, *WORKLOAD, "--repeats", "1",
        "--vllm-pythonpath", str(site), "--vllm-python", sys.executable, "--our-client",
        "--num-warmups", "3",
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["judge"] == "vllm bench serve" and summary["our_client_after_judge"]
    run = summary["workloads"]["custom"]["systems"]["S"]["runs"][0]
    assert run["metrics"]["completed"] == 12 and run["our_client"]["completed"] == 12
    assert "--num-warmups 3" in run["judge_command"] and "--save-detailed" in run["judge_command"]
    assert run["output_lens_digest"] is not None  # from the per-request arrays
    assert (out / "runs/custom/r0-S.json").exists() and (
        out / "runs/custom/r0-S-ours.json"
    ).exists()
    argv = (out / "runs/custom/argv.txt").read_text()
    assert "--ignore-eos" in argv and "--max-concurrency 4" in argv
    assert "--model fake-model" in argv  # named, so that vLLM's client aligns its prompts
    # The launch warm-up went through the judge first, with prompts of no workload.
    warmup = summary["launches"][0]["warmup"]
    assert warmup["completed"] == 48 and "--seed 4242 " in warmup["judge_command"]
    assert not (out / "runs/launch-warmup").exists()  # nothing of it kept but the record


def test_vllm_alone_beside_the_harness_figure(tokenizer_dir, tmp_path):
    """--alone B runs B again as B-alone in the same rotation, judged with the same commands
    and nothing else (no /metrics reads, no our client); the summary sets its figures beside
    B's and says which mode each came from."""
    a = fake_command(token_delay_ms=1)
    b = fake_command(token_delay_ms=4, spec_counters=1)
    out = tmp_path / "alone"
    code = paired(
        out, [f"A={a}", f"B={b}"], tokenizer_dir, *WORKLOAD, "--repeats", "3", "--judge", "ours",
        "--alone", "B", "--no-launch-warmup",
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["systems"] == ["A", "B"] and summary["alone_systems"] == ["B-alone"]
    assert summary["modes"] == {"A": "paired", "B": "paired", "B-alone": "alone"}
    # Three systems rotate: each is first, second and third once.
    assert summary["rounds"] == {
        "0": ["A", "B", "B-alone"], "1": ["B", "B-alone", "A"], "2": ["B-alone", "A", "B"]
    }  # fmt: skip
    alone = [x for x in summary["launches"] if x["system"] == "B-alone"]
    b_launch = next(x for x in summary["launches"] if x["system"] == "B")
    assert (
        len(alone) == 3
        and alone[0]["command"].split("--port")[0] == (b_launch["command"].split("--port")[0])
    )
    assert all(x["mode"] == "alone" and "warmup" not in x for x in alone)
    w = summary["workloads"]["custom"]
    runs = w["alone"]["B-alone"]["runs"]
    assert len(runs) == 3 and all(r["mode"] == "alone" and "speculation" not in r for r in runs)
    assert all(r["speculation"] is not None for r in w["systems"]["B"]["runs"])
    med = w["alone"]["B-alone"]["spread"]["output_throughput"]["median"]
    paired_med = w["systems"]["B"]["spread"]["output_throughput"]["median"]
    assert w["harness_vs_alone"]["B"]["output_throughput"] == pytest.approx(paired_med / med)
    assert w["ratio_of"] == "A/B" and "B-alone" not in w["systems"]


def test_alone_needs_a_system_the_harness_starts(tokenizer_dir, capsys):
    code = main(
        ["bench", "paired", "--system", "A=url:http://127.0.0.1:9", "--tokenizer",
         str(tokenizer_dir), "--judge", "ours", "--alone", "A"]
    )  # fmt: skip
    assert code != 0 and "--alone A" in capsys.readouterr().err


def test_start_repeat_continues_the_order(fake_server, tokenizer_dir, tmp_path):
    a, b = fake_server(token_delay_ms=0), fake_server(token_delay_ms=0)
    out = tmp_path / "out"
    code = paired(
        out, [f"A=url:{a.base_url}", f"B=url:{b.base_url}"], tokenizer_dir, *WORKLOAD,
        "--judge", "ours", "--repeats", "1", "--start-repeat", "1",
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == {"1": ["B", "A"]}
    assert summary["ready_s"]["A"]["median"] is None  # already running: no launch time


def test_failed_launch_is_reported_and_others_run(fake_server, tokenizer_dir, tmp_path):
    fast = fake_server(token_delay_ms=0)
    crash = f"{shlex.quote(sys.executable)} -c 'raise SystemExit(3)' --port {{port}}"
    out = tmp_path / "bad"
    code = paired(
        out, [f"fast=url:{fast.base_url}", f"bad={crash}"], tokenizer_dir, *WORKLOAD,
        "--judge", "ours", "--repeats", "1",
    )  # fmt: skip
    assert code == 1
    summary = json.loads((out / "summary.json").read_text())
    assert any("exited with code 3" in e for e in summary["errors"])
    assert (
        summary["workloads"]["custom"]["systems"]["fast"]["runs"][0]["metrics"]["completed"] == 12
    )
    assert summary["workloads"]["custom"]["systems"]["bad"]["runs"] == []
    assert any("did not happen" in e for e in summary["errors"])


def test_named_workloads_refuse_workload_flags(tokenizer_dir, tmp_path, capsys):
    code = main(
        ["bench", "paired", "--system", "A=url:http://127.0.0.1:9", "--tokenizer",
         str(tokenizer_dir), "--workload", "w1", "--num-prompts", "5", "--judge", "ours"]
    )  # fmt: skip
    assert code != 0 and "--workload fixes every workload flag" in capsys.readouterr().err


def test_gate_for_a_workload_not_run_is_refused(tokenizer_dir, tmp_path, capsys):
    code = main(
        ["bench", "paired", "--system", "A=url:http://127.0.0.1:9", "--tokenizer",
         str(tokenizer_dir), "--workload", "w1", "--judge", "ours",
         "--gate", "c256:output_throughput>=1"]
    )  # fmt: skip
    assert code != 0 and "names workload 'c256'" in capsys.readouterr().err


def test_vllm_judge_missing_is_refused(tokenizer_dir, tmp_path, capsys):
    code = main(
        ["bench", "paired", "--system", "A=url:http://127.0.0.1:9", "--tokenizer",
         str(tokenizer_dir), "--judge", "vllm", "--vllm-pythonpath", str(tmp_path)]
    )  # fmt: skip
    assert code != 0 and "--judge ours" in capsys.readouterr().err


def test_gpu_trace_is_opt_in_and_marks_the_run_traced(fake_server, tokenizer_dir, tmp_path):
    server = fake_server(token_delay_ms=0)
    out = tmp_path / "traced"
    code = paired(
        out, [f"S=url:{server.base_url}"], tokenizer_dir, *WORKLOAD, "--judge", "ours",
        "--repeats", "1", "--gpu-trace", "--no-launch-warmup",
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gpu_trace"] is True and summary["modes"] == {"S": "traced"}
    (launch,) = summary["launches"]
    assert launch["gpu"]["traced"] is True and launch["gpu"]["available"] is False  # no NVML
    assert summary["workloads"]["custom"]["systems"]["S"]["runs"][0]["mode"] == "traced"
