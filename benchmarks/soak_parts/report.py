"""What the soak leaves behind besides results.json: each server run's log tail in the result
folder, and the summary printed at the end (counts per class and kind, the failure table, the
kill, RSS per run, one [PASS]/[FAIL] line per check)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def log_tail(text: str, lines: int = 60, max_line: int = 300, max_bytes: int = 8000) -> str:
    """The last `lines` lines of a log, each cut to `max_line` characters, at most `max_bytes`."""
    out = []
    for line in text.splitlines()[-lines:]:
        line = line.split("\r")[-1]  # a progress bar redrawn in place: its last state
        out.append(line if len(line) <= max_line else line[:max_line] + " [...]")
    body = "\n".join(out)
    while len(body.encode()) > max_bytes and "\n" in body:
        body = body.split("\n", 1)[1]
    return body + "\n"


def write_logs(folder: Path, workdir: Path) -> None:
    """Each server run's log in `workdir`, as `server-<i>.tail.log` in `folder` (its tail only)."""
    for path in sorted(workdir.glob("server-*.log")):
        text = path.read_bytes().decode("utf-8", errors="replace")
        (folder / f"{path.stem}.tail.log").write_text(log_tail(text), encoding="utf-8")


def print_summary(result: dict[str, Any], folder: Path | None) -> None:
    """Counts, failures, the kill, RSS per run and one [PASS]/[FAIL] line per check."""
    counts = result.get("counts", {})
    print(f"soak: {result.get('traffic_s')} s of traffic, {counts.get('total')} requests")
    print(f"  by class: {counts.get('by_class')}")
    for kind, by in counts.get("by_kind", {}).items():
        print(f"  {kind:14s} {by}")
    if counts.get("bad_inputs"):
        print(f"  bad inputs (status): {counts['bad_inputs']}")
    for row in counts.get("failure_table", [])[:10]:
        print(f"  ! {row}")
    kill = {k: v for k, v in result.get("kill", {}).items() if k != "restart_ready_mono"}
    if kill:
        print(f"  kill: {kill}")
    for seg in result.get("rss", {}).get("segments", []):
        b, e = seg["baseline"], seg["end"]
        print(
            f"  rss run {seg['run']}: {b and b['total_mib']} -> {e and e['total_mib']} MiB "
            f"(growth {seg['growth']})"
        )
    for name, c in result.get("checks", {}).items():
        print(
            f"  [{'PASS' if c['pass'] else 'FAIL'}] {name}: {c['value']}"
            + (f" (limit {c['limit']})" if "limit" in c else "")
        )
    print(
        f"soak: {'PASSED' if result.get('passed') else 'FAILED'}"
        + (f"; results in {folder}" if folder else "")
    )
