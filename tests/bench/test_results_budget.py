"""The committed result folders stay within their size budget (compact them with
`python benchmarks/compact_results.py`)."""

from __future__ import annotations

from pathlib import Path

from inferengine.bench.compact import FOLDER_BUDGET_BYTES, RESULTS_BUDGET_BYTES, folder_bytes

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def result_folders() -> list[Path]:
    assert RESULTS.is_dir(), f"{RESULTS} is missing"
    return sorted(p for p in RESULTS.iterdir() if p.is_dir())


def test_every_result_folder_is_within_budget():
    over = {f.name: folder_bytes(f) for f in result_folders()}
    over = {name: size for name, size in over.items() if size > FOLDER_BUDGET_BYTES}
    assert not over, (
        f"over {FOLDER_BUDGET_BYTES:,} bytes (run benchmarks/compact_results.py): {over}"
    )


def test_all_results_are_within_budget():
    assert result_folders(), f"no result folders under {RESULTS}"
    total = folder_bytes(RESULTS)
    assert total <= RESULTS_BUDGET_BYTES, f"benchmarks/results holds {total:,} bytes"
