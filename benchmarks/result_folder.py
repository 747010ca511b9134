"""Writes a benchmark's result folder: raw JSON, the command line and the environment."""

from __future__ import annotations

import json
import os
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def write_result_folder(
    name: str,
    results: dict[str, Any],
    out_dir: str | Path | None = None,
    *,
    root: str | Path | None = None,
) -> Path:
    """`<root>/<UTC stamp>-<name>/` (root: `benchmarks/results`), or exactly `out_dir`, with
    results.json, command.txt and environment.txt (naming `GIT_REV` as the revision measured,
    when set); compacted if over its size budget."""
    from inferengine.bench.compact import FOLDER_BUDGET_BYTES, compact_folder, folder_bytes
    from inferengine.bench.environment import environment_text

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    folder = Path(out_dir) if out_dir else Path(root or RESULTS) / f"{stamp}-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    command = shlex.join([sys.executable, *sys.argv])
    (folder / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (folder / "command.txt").write_text(command + "\n")
    # GIT_REV: the revision of a copied checkout (the GPU host's .git copy may be stale).
    revision = os.environ.get("GIT_REV") or None
    (folder / "environment.txt").write_text(environment_text({name: command}, revision))
    if folder_bytes(folder) > FOLDER_BUDGET_BYTES:
        report = compact_folder(folder)
        print(
            f"{folder}: {report['bytes_before']:,} bytes is over the {FOLDER_BUDGET_BYTES:,} "
            f"budget; compacted to {report['bytes_after']:,} (see COMPACTED.txt):"
        )
        for action in report["actions"]:
            print(f"  {action}")
    return folder
