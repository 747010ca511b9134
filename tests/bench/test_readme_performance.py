"""The performance page's tables and the README's headline table are exactly what
benchmarks/readme_performance.py makes of the result folders, and the script lists every run at
the newest revision, not the best one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_page_and_readme_match_the_result_folders():
    script = load_script("benchmarks/readme_performance.py")
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    assert script.BEGIN in page and script.END in page
    assert script.replace_section(page, script.render()) == page, (
        "docs/performance.md's tables are stale: run python benchmarks/readme_performance.py"
    )
    spec = script.replace_section(page, script.render_spec(), script.SPEC_BEGIN, script.SPEC_END)
    assert spec == page, "docs/performance.md's speculation table is stale: run the same script"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    headline = script.replace_section(
        readme, script.render_headline(), script.HEADLINE_BEGIN, script.HEADLINE_END
    )
    assert headline == readme, "README.md's headline table is stale: run the same script"
    # Speculation folders stay out of the InferEngine-versus-vLLM table.
    assert "-spec-" not in script.render()


def summary(revision: str, repeat: int, thr: dict[str, float]) -> dict:
    def run(system: str) -> dict:
        metrics = {"output_throughput": thr[system], "median_ttft_ms": 10.0, "busy_pct": 50.0}
        return {"repeat": repeat, "system": system, "metrics": metrics}

    systems = list(thr)
    return {
        "format": "inferengine-bench-paired/2",
        "revision": revision,
        "judge": "vllm bench serve",
        "judge_version": "vllm-0.26.0",
        "gpu": "gpu 0: NVIDIA H100 80GB HBM3, 79.6 GiB",
        "model_dir": "configs/x",
        "systems": systems,
        "busy_window": "the judge's measured window",
        "workloads": {
            "w1": {
                "description": "w1 text",
                "systems": {s: {"runs": [run(s)]} for s in systems},
            }
        },
        "launches": [{"system": s, "ready_s": 10.0 + repeat, "repeat": repeat} for s in systems],
    }


def test_every_run_of_the_newest_revision_is_listed(tmp_path):
    script = load_script("benchmarks/readme_performance.py")
    results = tmp_path / "results"
    folders = {
        "20260101T000000Z-paired-r0": summary("old", 0, {"inferengine": 999.0, "vllm": 1.0}),
        "20260102T000000Z-paired-r0": summary("new", 0, {"inferengine": 100.0, "vllm": 50.0}),
        "20260102T010000Z-paired-r1": summary("new", 1, {"inferengine": 130.0, "vllm": 40.0}),
        "20260102T020000Z-paired-r2": summary("new", 2, {"inferengine": 90.0, "vllm": 60.0}),
    }
    for name, data in folders.items():
        (results / name).mkdir(parents=True)
        (results / name / "summary.json").write_text(json.dumps(data))
    text = script.render(results)
    assert "**100** (100 · 130 · 90)" in text and "**50** (50 · 40 · 60)" in text
    assert "| 2.00 |" in text  # the ratio of the medians
    assert "999" not in text  # the old revision's (better) run is not quoted
    assert "3 round(s) at new" in text and "20260101T000000Z" not in text
    assert "InferEngine 50%" in text and "ready after launch" in text
    assert "NVIDIA H100 80GB HBM3" in text
    shutil.rmtree(results / "20260102T020000Z-paired-r2")
    assert "**115** (100 · 130)" in script.render(results)


def test_fp8_runs_get_a_table_of_their_own(tmp_path):
    """Folders whose servers all ran `--quantization fp8` are never mixed into the bf16 table,
    however new their revision; a folder whose servers ran different formats is in neither."""
    script = load_script("benchmarks/readme_performance.py")
    results = tmp_path / "results"
    bf16 = summary("old", 0, {"inferengine": 100.0, "vllm": 50.0})
    fp8 = summary("new", 0, {"inferengine": 300.0, "vllm": 100.0})
    for launch in fp8["launches"]:
        launch["command"] = "serve configs/x --quantization fp8 --kv-cache-dtype fp8"
    mixed = summary("newest", 0, {"inferengine": 777.0, "vllm": 1.0})
    mixed["launches"][0]["command"] = "serve configs/x --quantization fp8"
    folders = {
        "20260101T000000Z-paired-r0": bf16,
        "20260102T000000Z-fp8-r0": fp8,
        "20260103T000000Z-mixed-r0": mixed,  # FP8 against bf16: left out of every table
    }
    for name, data in folders.items():
        (results / name).mkdir(parents=True)
        (results / name / "summary.json").write_text(json.dumps(data))
    text = script.render(results)
    _, bf16_table, fp8_table = text.split("### ")
    assert "FP8 weights and KV cache" in fp8_table
    assert "| 100 | 50 | 2.00 |" in bf16_table and "1 round(s) at old" in bf16_table
    assert "| 300 | 100 | 3.00 |" in fp8_table and "1 round(s) at new" in fp8_table
    assert "300" not in bf16_table and "bf16, dummy weights" in bf16_table
    assert "777" not in text and "newest" not in text


def test_headline_counts_every_workload(tmp_path):
    """The README's headline takes the same medians as the page and counts, among every table's
    workloads, those where ours is slower, naming them."""
    script = load_script("benchmarks/readme_performance.py")
    results = tmp_path / "results"
    folders = {
        "20260102T000000Z-paired-r0": summary("new", 0, {"inferengine": 100.0, "vllm": 50.0}),
        "20260102T010000Z-paired-r1": summary("new", 1, {"inferengine": 130.0, "vllm": 40.0}),
    }
    slow = summary("new", 0, {"inferengine": 10.0, "vllm": 20.0})
    slow["workloads"]["json-c16"] = slow["workloads"].pop("w1")
    folders["20260102T020000Z-json-r0"] = slow
    for name, data in folders.items():
        (results / name).mkdir(parents=True)
        (results / name / "summary.json").write_text(json.dumps(data))
    text = script.render_headline(results)
    assert "| w1 | 115 | 45 | **2.56** |" in text and "NVIDIA H100 80GB HBM3" in text
    assert "json-c16 |" not in text  # in the count, not a row
    assert "above vLLM's in 1 of 2 paired workloads; below in json-c16 (configs/x, bf16)." in text
