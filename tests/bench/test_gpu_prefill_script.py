"""benchmarks/gpu_prefill.sh --dry-run: the commands the GPU session will run, each parsed by
our CLI, with the rotation, vLLM alone, the workloads and the server lengths each set needs."""

from __future__ import annotations

import shlex
import subprocess

from inferengine.bench.cli import paired_workloads
from inferengine.bench.gates import parse_gate
from inferengine.entrypoints.cli.main import build_parser


def dry_run(*items: str) -> list[str]:
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_prefill.sh", "--dry-run", *items],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return [line for line in proc.stdout.splitlines() if not line.startswith("#")]


def test_dry_run_prints_one_parsable_command_per_item():
    short, long, profile = dry_run("0:short", "1:long", "profile")
    for line, round_, length, workloads in (
        (short, "0", "2048", ["w1", "batch1", "c256", "shared-prefix"]),
        (long, "1", "8448", ["rag", "long-prompt", "batch1-8k", "prefill-only"]),
    ):
        argv = shlex.split(line)
        assert argv[:4] == ["python3", "-m", "inferengine.entrypoints.cli.main", "bench"]
        args = build_parser().parse_args(argv[3:])
        assert args.alone == ["vllm"] and args.judge == "vllm" and args.start_repeat == int(round_)
        assert [s.split("=")[0] for s in args.system] == ["inferengine", "vllm"]
        assert all(s.endswith(f"--max-model-len {length}") for s in args.system)
        assert [w.name for w in paired_workloads(args)] == workloads
        assert {parse_gate(g).workload for g in args.gate} <= set(workloads)
        assert not args.gpu_trace and args.launch_warmup  # nothing beside the judge
    assert "benchmarks/prefill_profile.py" in profile and "--out /tmp/pr/" in profile


def test_unknown_items_are_refused():
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_prefill.sh", "--dry-run", "0:medium"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 2 and "unknown item 0:medium" in proc.stderr
