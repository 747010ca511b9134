"""Shrinks a benchmark result folder to its summaries, so `benchmarks/results` stays small.

Per-request arrays and generated text go, every summary figure stays as measured; logs keep
their head and tail; GPU traces and JUnit XML become small JSON summaries. Git history holds
the originals. No torch here: this runs on machines that only carry result folders.
"""

from __future__ import annotations

import csv
import gzip
import json
import re
import statistics
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Any

FOLDER_BUDGET_BYTES = 200_000
RESULTS_BUDGET_BYTES = 3_000_000
SMALL_FILE_BYTES = 16_000  # files up to this size are left as they are
INDENTED_JSON_BYTES = 100_000  # a larger JSON is rewritten without whitespace
MAX_LIST_ITEMS = 64
MAX_TRACE_GZ_BYTES = 64 * 2**20  # a larger gzipped Chrome trace is dropped, not summarised
NOTE = "per-request arrays dropped to keep the folder small; summary fields are as measured"
# Per-request fields of `bench serve` results (ours and vLLM's), dropped at any length.
_TIMES = ("ttfts", "itls", "start_times", "latencies")
_LENS = ("input_lens", "output_lens", "expected_input_lens", "expected_output_lens")
PER_REQUEST_FIELDS = frozenset({*_TIMES, *_LENS, "generated_texts", "errors"})


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _compact(obj: dict, path: str, dropped: list[str], summarised: list[str]) -> dict:
    serve_result = "ttfts" in obj
    out = {}
    for key, value in obj.items():
        name = f"{path}{key}"
        if key == "compacted" or not isinstance(value, dict | list):  # ours: kept as is
            out[key] = value
        elif isinstance(value, dict):
            out[key] = _compact(value, f"{name}.", dropped, summarised)
        elif key == "generated_texts" or (serve_result and key in PER_REQUEST_FIELDS):
            dropped.append(name)
        elif len(value) <= MAX_LIST_ITEMS:
            out[key] = [
                _compact(v, f"{name}[].", dropped, summarised) if isinstance(v, dict) else v
                for v in value
            ]
        elif all(map(_is_number, value)):
            out[key] = {"n": len(value), "min": min(value), "median": statistics.median(value)}
            out[key]["max"] = max(value)
            summarised.append(name)
        elif all(isinstance(v, dict) for v in value):  # table rows: the data itself
            out[key] = [_compact(v, f"{name}[].", dropped, summarised) for v in value]
        else:  # long lists of text or of lists: per-item data
            dropped.append(name)
    return out


def compact_result(result: dict) -> dict:
    """`result` without per-request arrays and generated text, long numeric lists summarised
    as {n, min, median, max}, plus a `compacted` record; unchanged when nothing goes."""
    dropped: list[str] = []
    summarised: list[str] = []
    out = _compact(result, "", dropped, summarised)
    if not dropped and not summarised:
        return result
    done = out.get("compacted") or {}
    record = {"dropped": list(dict.fromkeys([*done.get("dropped", []), *dropped]))}
    if summarised or done.get("summarised"):
        record["summarised"] = list(dict.fromkeys([*done.get("summarised", []), *summarised]))
    record["note"] = NOTE
    out["compacted"] = record
    return out


def trim_log(
    path: Path,
    head: int = 40,
    tail: int = 120,
    max_line_chars: int = 400,
    keep: str | None = None,
    keep_max: int = 200,
) -> str | None:
    """Keeps the first `head` and last `tail` lines, and up to `keep_max` lines between them
    that match the regex `keep` (a server's periodic stats), and cuts overlong lines (progress
    bars), in place; says what it did, or None when the log was left as is."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    ends_with_newline = text.endswith("\n")
    lines = text.removesuffix("\n").split("\n")
    notes = []
    middle = lines[head : max(head, len(lines) - tail)]
    kept = [x for x in middle if keep and re.search(keep, x)][-keep_max:]
    gap = len(middle) - len(kept)
    if gap > 1:  # one line is the mark of an earlier trim
        mark = f"[... {gap} lines dropped"
        mark += f", {len(kept)} matching {keep!r} kept ...]" if kept else " ...]"
        lines = [*lines[:head], mark, *kept, *lines[len(lines) - tail :]]
        notes.append(f"kept the first {head} and last {tail} lines, dropped {gap}")
    cut = 0
    keep = max_line_chars - 30  # room for the mark, so a second pass finds nothing to cut
    for i, line in enumerate(lines):
        if len(line) > max_line_chars:
            if "\r" in line:  # a progress bar redrawn in place: its first and last states
                states = [s for s in line.split("\r") if s.strip()] or [""]
                line = f"{states[0]} [...] {states[-1]}" if len(states) > 1 else states[0]
            cut += 1
            if len(line) > max_line_chars:
                line = f"{line[:keep]} [... {len(line) - keep} chars cut]"
            lines[i] = line
    notes += [f"cut {cut} lines to {max_line_chars} characters"] if cut else []
    if not notes:
        return None
    path.write_text("\n".join(lines) + ("\n" if ends_with_newline else ""), encoding="utf-8")
    return "; ".join(notes)


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None  # None: no such readings


def summarise_gpu_csv(path: Path) -> dict[str, Any]:
    """Per phase and GPU of a `gpu_trace.py` CSV: seconds, samples, busy_pct (mean of NVML's
    utilization.gpu, the share of time some kernel ran), mem_util_pct, peak memory, power."""
    text = path.read_text(encoding="utf-8").splitlines()
    unavailable = [line[1:].strip() for line in text if line.startswith("#")]
    groups: dict[tuple[str, str], list[dict[str, str]]] = {}
    for row in csv.DictReader(line for line in text if line and not line.startswith("#")):
        groups.setdefault((row["phase"], row["gpu"]), []).append(row)
    phases = []
    for (phase, gpu), rows in groups.items():
        t = [float(r["t_s"]) for r in rows]
        power = [float(r["power_w"]) for r in rows if r["power_w"]]
        phases.append(
            {
                "phase": phase,
                "gpu": int(gpu),
                "seconds": round(max(t) - min(t), 3),
                "samples": len(rows),
                "busy_pct": _mean([float(r["util_pct"]) for r in rows]),
                "mem_util_pct": _mean([float(r["mem_util_pct"]) for r in rows]),
                "peak_mem_used_mib": max(float(r["mem_used_mib"]) for r in rows),
                "mem_total_mib": float(rows[0]["mem_total_mib"]),
                "mean_power_w": _mean(power),
            }
        )
    return {
        "source": path.name,
        "unavailable": unavailable[0] if unavailable else None,
        "note": "busy_pct is NVML's utilization.gpu: the share of time a kernel ran, not SM use",
        "phases": phases,
    }


def summarise_chrome_trace(path: Path, top: int = 20) -> dict[str, Any] | None:
    """GPU time per kernel (and memcpy/memset) of a gzipped Chrome trace, or None when it is
    too large or unreadable."""
    if path.stat().st_size > MAX_TRACE_GZ_BYTES:
        return None
    try:
        trace = json.loads(gzip.decompress(path.read_bytes()))
    except (OSError, ValueError, EOFError):
        return None
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    total: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
    return {
        "source": path.name,
        "num_events": len(events),
        "gpu_ms_total": round(sum(total.values()) / 1000, 4),
        "top_kernels": [
            {"name": n[:200], "calls": count[n], "total_ms": round(us / 1000, 4)}
            for n, us in total.most_common(top)
        ],
    }


def summarise_junit(path: Path) -> dict[str, Any]:
    """Totals, failures, skip reasons, recorded properties and the slowest tests of JUnit XML."""
    root = ET.parse(path).getroot()
    totals = Counter()
    for suite in root.iter("testsuite"):
        for key in ("tests", "failures", "errors", "skipped"):
            totals[key] += int(suite.get(key, 0))
        totals["time_s"] += float(suite.get("time", 0))
    passed = totals["tests"] - totals["failures"] - totals["errors"] - totals["skipped"]
    failed, skips, properties, times = [], Counter(), {}, []
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        times.append((float(case.get("time", 0)), name))
        for tag in ("failure", "error"):
            for e in case.iter(tag):
                failed.append({"test": name, tag: (e.get("message") or e.text or "")[:300]})
        for e in case.iter("skipped"):
            skips[(e.get("message") or "")[:200]] += 1
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props:
            properties[name] = props
    return {
        "source": path.name,
        "totals": {**totals, "passed": passed, "time_s": round(totals["time_s"], 3)},
        "failed": failed,
        "skip_reasons": dict(skips.most_common(20)),
        "properties": properties,
        "slowest": [{"test": n, "time_s": t} for t, n in sorted(times, reverse=True)[:10]],
    }


def _dump_json(obj: Any) -> str:
    text = json.dumps(obj, indent=1) + "\n"
    if len(text) <= INDENTED_JSON_BYTES:
        return text
    return json.dumps(obj, separators=(",", ":")) + "\n"


def _compact_json(path: Path, folder: Path) -> str | None:
    gz = path.name.endswith(".gz")
    text = (gzip.decompress(path.read_bytes()) if gz else path.read_bytes()).decode("utf-8")
    result = json.loads(text)
    if not isinstance(result, dict):
        return None
    compacted = compact_result(result)
    new_text = _dump_json(compacted)
    if compacted is result:  # nothing to drop: only a large file loses its indentation
        if len(text) <= INDENTED_JSON_BYTES or len(new_text) >= len(text):
            return None
        note = "rewritten with less whitespace (nothing dropped)"
    else:
        record = compacted["compacted"]
        verbs = [v for v in ("dropped", "summarised") if record.get(v)]
        note = "; ".join(f"{v} {', '.join(record[v])}" for v in verbs)
    plain = folder / path.name.removesuffix(".gz")
    if gz and len(new_text) <= INDENTED_JSON_BYTES and not plain.exists():
        plain.write_text(new_text, encoding="utf-8")
        path.unlink()
        return f"{path.name}: {note}; now plain {plain.name}"
    if gz:
        path.write_bytes(gzip.compress(new_text.encode("utf-8"), mtime=0))
    else:
        path.write_text(new_text, encoding="utf-8")
    return f"{path.name}: {note}"


def _replace(path: Path, summary: dict[str, Any], target: str, what: str) -> str:
    path.with_name(target).write_text(_dump_json(summary), encoding="utf-8")
    path.unlink()
    return f"{path.name}: replaced by {target} ({what})"


def _compact_file(path: Path, folder: Path) -> str | None:
    name = path.name
    if name in ("comparison.json", "COMPACTED.txt"):
        return None
    if name == "trace.json.gz" or name.endswith(".trace.json.gz"):
        summary = summarise_chrome_trace(path)
        if summary is None:
            path.unlink()
            return f"{name}: dropped (Chrome trace too large or unreadable to summarise)"
        stem = name.removesuffix(".json.gz").removesuffix(".trace")
        return _replace(path, summary, f"{stem}-top-kernels.json", "GPU time per kernel")
    if name.endswith((".json", ".json.gz")):
        return _compact_json(path, folder)
    if name.endswith(".log"):
        note = trim_log(path)
        return f"{name}: {note}" if note else None
    if name.endswith("-gpu.csv"):
        summary, stem = summarise_gpu_csv(path), name.removesuffix(".csv")
        return _replace(path, summary, f"{stem}-summary.json", "per-phase means and peaks")
    if name.endswith(".xml"):
        summary, stem = summarise_junit(path), name.removesuffix(".xml")
        return _replace(path, summary, f"{stem}-summary.json", "JUnit totals and failures")
    return None


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under `folder`."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def compact_folder(folder: Path) -> dict[str, Any]:
    """Compacts every file over SMALL_FILE_BYTES in `folder` (comparison.json excepted; GPU
    CSVs all or none, so systems compare) and notes it in COMPACTED.txt; idempotent."""
    folder = Path(folder)
    before = folder_bytes(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    big = {p for p in files if p.stat().st_size > SMALL_FILE_BYTES}
    if any(p.name.endswith("-gpu.csv") for p in big):
        big |= {p for p in files if p.name.endswith("-gpu.csv")}
    actions = [a for p in files if p in big and (a := _compact_file(p, folder))]
    if actions:
        note = folder / "COMPACTED.txt"
        header = (
            "Compacted by benchmarks/compact_results.py (inferengine/bench/compact.py) to keep\n"
            f"this folder under {FOLDER_BUDGET_BYTES:,} bytes; git history holds the original\n"
            f"files (in benchmarks/results: git log --stat -- {folder.name}).\n\n"
        )
        old = note.read_text(encoding="utf-8") if note.exists() else header
        note.write_text(old + "".join(f"- {a}\n" for a in actions), encoding="utf-8")
    return {
        "folder": str(folder),
        "bytes_before": before,
        "bytes_after": folder_bytes(folder),
        "actions": actions,
    }
