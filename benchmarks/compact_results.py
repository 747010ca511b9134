"""Keeps result folders within their size budget: compacts them in place, or checks them.

    python benchmarks/compact_results.py [FOLDER ...]          # compact, print before/after
    python benchmarks/compact_results.py --check [FOLDER ...]  # exit 1 if over budget

Without folders: every folder under `benchmarks/results`. Compacting drops per-request arrays,
generated text and long logs' middles, and turns GPU traces into summaries
(`inferengine/bench/compact.py`); each touched folder says what went in COMPACTED.txt.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inferengine.bench.compact import (
    FOLDER_BUDGET_BYTES,
    RESULTS_BUDGET_BYTES,
    compact_folder,
    folder_bytes,
)

RESULTS = Path(__file__).resolve().parent / "results"


def check(folders: list[Path]) -> int:
    """Prints the folders over FOLDER_BUDGET_BYTES and the total; 1 if anything is over."""
    over = [(f, folder_bytes(f)) for f in folders if folder_bytes(f) > FOLDER_BUDGET_BYTES]
    total = sum(folder_bytes(f) for f in folders)
    for folder, size in over:
        print(f"over budget: {folder.name}: {size:,} bytes > {FOLDER_BUDGET_BYTES:,}")
    if total > RESULTS_BUDGET_BYTES:
        print(f"over budget: total {total:,} bytes > {RESULTS_BUDGET_BYTES:,}")
    print(f"{len(folders)} folders, {total:,} bytes in all, {len(over)} over budget")
    return 1 if over or total > RESULTS_BUDGET_BYTES else 0


def compact(folders: list[Path]) -> None:
    """Compacts every folder and prints bytes before and after."""
    width = max((len(f.name) for f in folders), default=6)
    print(f"{'folder':<{width}}  {'before':>10}  {'after':>10}  actions")
    before = after = 0
    for folder in folders:
        report = compact_folder(folder)
        before += report["bytes_before"]
        after += report["bytes_after"]
        flag = "  OVER BUDGET" if report["bytes_after"] > FOLDER_BUDGET_BYTES else ""
        print(
            f"{folder.name:<{width}}  {report['bytes_before']:>10,}  {report['bytes_after']:>10,}"
            f"  {len(report['actions'])}{flag}"
        )
    print(f"{'total':<{width}}  {before:>10,}  {after:>10,}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path, help="default: benchmarks/results/*")
    parser.add_argument("--check", action="store_true", help="only check the budget")
    args = parser.parse_args(argv)
    folders = args.folders or sorted(p for p in RESULTS.iterdir() if p.is_dir())
    if args.check:
        return check(folders)
    compact(folders)
    return 0


if __name__ == "__main__":
    sys.exit(main())
