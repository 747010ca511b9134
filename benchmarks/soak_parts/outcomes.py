"""Each request's outcome and what the run makes of them: the classes (ok, rejected_4xx,
unexpected_4xx, cut_by_kill, failed) around the kill window, counts per class and kind, the
failure table, latencies and throughput of the ok requests."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

CLASSES = ("ok", "rejected_4xx", "unexpected_4xx", "cut_by_kill", "failed")


@dataclass
class Record:
    """One request's outcome; classified at the end, when the kill window is known."""

    kind: str
    start: float  # seconds since the run's start
    end: float = 0.0
    ok: bool = False
    expect_4xx: bool = False
    status: int | None = None
    error: str | None = None  # "connect", "timeout", "read", "bad_response", "stream_error", ...
    detail: str = ""  # a short message for the failure table (no generated text)
    variant: str = ""  # which bad input
    completion_tokens: int = 0
    cached_tokens: int | None = None
    turn: int = 0


def classify(rec: Record, kill_window: tuple[float, float] | None) -> str:
    """One of CLASSES. A 4xx for a good input is never excused by the kill; any other failure
    of a request in flight at some moment of the kill window is."""
    if rec.ok:
        return "ok"
    is_4xx = rec.status is not None and 400 <= rec.status < 500
    if rec.expect_4xx and is_4xx:
        return "rejected_4xx"
    if is_4xx and not rec.expect_4xx:
        return "unexpected_4xx"
    if kill_window is not None and rec.start < kill_window[1] and rec.end > kill_window[0]:
        return "cut_by_kill"
    return "failed"


def tally(records: list[Record], kill_window: tuple[float, float] | None) -> dict[str, Any]:
    """Counts per class and per kind, bad inputs by variant and status, the failure table."""
    by_class: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    bad: dict[str, Counter[str]] = {}
    failures: Counter[tuple] = Counter()
    for rec in records:
        cls = classify(rec, kill_window)
        by_class[cls] += 1
        by_kind.setdefault(rec.kind, Counter())[cls] += 1
        if rec.expect_4xx:
            bad.setdefault(rec.variant, Counter())[str(rec.status or rec.error)] += 1
        if cls in ("failed", "unexpected_4xx", "cut_by_kill"):
            key = (cls, rec.kind, rec.variant, rec.status, rec.error, rec.detail[:160])
            failures[key] += 1
    table = [
        dict(zip(("class", "kind", "variant", "status", "error", "detail"), k, strict=True))
        | {"count": n}
        for k, n in failures.most_common(24)
    ]
    return {
        "total": len(records),
        "by_class": {c: by_class.get(c, 0) for c in CLASSES},
        "by_kind": {k: {c: n for c, n in v.items()} for k, v in sorted(by_kind.items())},
        "bad_inputs": {k: dict(v) for k, v in sorted(bad.items())},
        "failure_table": table,
    }


def latency_summary(records: list[Record]) -> dict[str, dict[str, float]]:
    """Median and max seconds of the ok requests of each kind."""
    by_kind: dict[str, list[float]] = {}
    for rec in records:
        if rec.ok:
            by_kind.setdefault(rec.kind, []).append(rec.end - rec.start)
    return {
        k: {"n": len(v), "median_s": round(statistics.median(v), 3), "max_s": round(max(v), 3)}
        for k, v in sorted(by_kind.items())
    }


def traffic_summary(
    records: list[Record], sessions: int, started_s: float, end_s: float, traffic_s: float
) -> dict[str, Any]:
    """Latencies of the ok requests, agent sessions (later turns ok, and with cached tokens),
    tokens generated, and ok requests per second of the traffic between `started_s` and
    `end_s` (run seconds)."""
    later = [r for r in records if r.kind == "agent_session" and r.turn > 1 and r.ok]
    ok = [r for r in records if r.ok]
    timed = [r for r in ok if started_s <= r.start < end_s]
    return {
        "latency_ok": latency_summary(records),
        "agent_sessions": {
            "sessions": sessions,
            "later_turns_ok": len(later),
            "later_turns_with_cached_tokens": sum(bool(r.cached_tokens) for r in later),
        },
        "completion_tokens_ok": sum(r.completion_tokens for r in ok),
        "ok_requests_per_s": round(len(timed) / max(traffic_s, 1e-9), 3),
    }
