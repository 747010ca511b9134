"""`benchmarks/gpu_tp_scaling.py` without a GPU: its items, the command lines --dry-run prints
(which the live `bench paired` parser and presets accept), and the tables from result folders."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from inferengine.bench.systems import parse_system
from inferengine.entrypoints.cli.main import build_parser
from tests.conftest import load_script

script = load_script("benchmarks/gpu_tp_scaling.py", "gpu_tp_scaling", register=True)


def test_items_name_a_kind_a_shape_and_a_size():
    assert script.parse_item("paired:llama-3-70b:2") == script.Item("paired", "llama-3-70b", 2)
    assert script.parse_item("alone:llama-3.1-8b:1:3").round == 3
    for bad, why in [
        ("paired:llama-3-70b:1", "runs at TP 2, 4"),
        ("scaling:llama-3-70b:2", "KIND one of"),
        ("c128:qwen:2", "MODEL is one of"),
        ("c128:llama-3.1-8b:2:x", "ROUND is a number"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            script.parse_item(bad)
    with pytest.raises(SystemExit):
        script.main(["--dry-run", "paired:llama-3-70b:16"])
    assert script.Item("paired", "llama-3-70b", 2).device_kind == "nvidia-h200-x2 (needs_h200)"
    assert script.Item("alone", "llama-3.1-8b", 4).device_kind == "nvidia-h100-x4"
    assert script.Item("paired", "llama-3-70b", 8).device_kind == "nvidia-h100-x8"  # [31]


def _printed(capsys, *items: str) -> list[str]:
    argv = ["--dry-run", "--stamp", "S", "--revision", "abc", *items]
    assert script.main(argv) == 0
    return capsys.readouterr().out.splitlines()


def test_dry_run_prints_bench_paired_lines_the_live_parser_takes(capsys):
    lines = _printed(capsys, "paired:llama-3-70b:4:1", "ray:llama-3.1-8b:2")
    assert lines[0] == "# tp4-llama-3-70b-paired round 1: device kind nvidia-h100-x4"
    assert lines[1].startswith(". benchmarks/gpu_peer_site.sh && { env ")
    assert "NCCL_NVLS_ENABLE=0" in lines[1]
    assert lines[1].endswith(
        'tar czf "$OUT/S-tp4-llama-3-70b-paired-r1.tgz" -C /tmp/pr S-tp4-llama-3-70b-paired-r1'
    )
    assert 'python3 -c "import ray"' in lines[3]
    parser = build_parser()
    for line in (lines[1], lines[3]):
        words = shlex.split(line.split("env ", 1)[1].split(" 2>&1")[0])
        start = words.index("bench")
        args = parser.parse_args(words[start:])
        assert all("--tensor-parallel-size" in spec for spec in args.system)
        ours = [s for s in args.system if not s.startswith("vllm=")]  # vLLM's needs its site
        for spec in ours:
            assert (
                "serve configs/"
                in parse_system(spec, args.model_dir, args.served_model_name).command
            )
    paired = shlex.split(lines[1].split("env ", 1)[1].split(" 2>&1")[0])
    assert paired[paired.index("--start-repeat") + 1] == "1"
    assert [paired[i + 1] for i, w in enumerate(paired) if w == "--workload"] == ["w1", "batch1"]
    assert "--gate" in paired and "--tensor-parallel-size 4" in " ".join(paired)
    assert "--distributed-executor-backend ray" in lines[3]


def _folder(tmp_path, name: str, workloads: dict) -> str:
    folder = tmp_path / name
    folder.mkdir()
    entries = {}
    for workload, (by_system, floor) in workloads.items():
        spread = {
            system: {"spread": {m: {"median": v} for m, v in metrics.items()}}
            for system, metrics in by_system.items()
        }
        entries[workload] = {"systems": spread, "floor": {"floor_ms": floor} if floor else None}
    summary = {"name": name, "workloads": entries}
    (folder / "summary.json").write_text(json.dumps(summary))
    return str(folder)


def test_tables_from_result_folders(tmp_path, capsys):
    tput, tpot = "output_throughput", "median_tpot_ms"
    folders = [
        _folder(
            tmp_path,
            "tp2-llama-3-70b-paired",
            {
                "w1": ({"inferengine": {tput: 550.0}, "vllm": {tput: 500.0}}, None),
                "batch1": ({"inferengine": {tpot: 19.6}, "vllm": {tpot: 21.0}}, 16.4),
            },
        ),
        _folder(
            tmp_path, "tp1-llama-3.1-8b-alone", {"c128": ({"inferengine": {tput: 3000.0}}, None)}
        ),
        _folder(
            tmp_path, "tp2-llama-3.1-8b-alone", {"c128": ({"inferengine": {tput: 4500.0}}, None)}
        ),
        str(tmp_path / "not-a-result"),
    ]
    assert script.main(["tables", *folders]) == 0
    out = capsys.readouterr().out
    assert "| llama-3-70b | 2 | 550 | 500 | 1.10 |" in out
    assert "| llama-3-70b | 2 | 16.40 | 19.60 | 1.20 | 21.00 | 1.28 |" in out
    assert "| llama-3.1-8b | 1 | – | 3,000 | 1.00 | – |" in out
    assert "| llama-3.1-8b | 2 | – | 4,500 | 1.50 | – |" in out
    assert "Ray executor" not in out  # no ray folder given
