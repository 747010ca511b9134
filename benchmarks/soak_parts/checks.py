"""The soak's pass/fail checks, each a small record (pass, value, limit, note): the server idle
at the end, RSS growth per server run, the request classes and kinds, and server exits that
were neither the kill's nor the final stop's."""

from __future__ import annotations

from typing import Any

from .outcomes import Record
from .payloads import KINDS
from .rss import rss_growth
from .server_probes import is_idle

# The end state's fields that must be zero for the idle check.
IDLE_FIELDS = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "stats.kv_pages_used",
    "stats.num_requests_in_flight",
)


def check(passed: bool | None, value: Any, limit: Any = None, note: str = "") -> dict[str, Any]:
    """A check's record; passed None (could not be measured) counts as a failure."""
    out: dict[str, Any] = {"pass": bool(passed), "value": value}
    if limit is not None:
        out["limit"] = limit
    if note:
        out["note"] = note
    return out


def idle_check(metrics: dict | None, stats: dict | None, state: dict[str, Any]) -> dict:
    """No request running or waiting and no KV page held by a request, from the last scrape
    (`state`: its end_state)."""
    return check(
        is_idle(metrics, stats),
        {k: state[k] for k in IDLE_FIELDS},
        note="kv_cache_usage_perc and kv_pages_used count pages with a reference; "
        "prefix-cached and leased free pages are free",
    )


def rss_checks(
    baselines: list[dict | None], ends: list[dict | None], max_growth: float
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per server run, its warm baseline against its last sample: the segments (baseline, end,
    growth) and the checks `rss_growth_run<i>`."""
    segments, checks = [], {}
    for i, base in enumerate(baselines):
        end = ends[i] if i < len(ends) else None
        growth = rss_growth(base and base["total_mib"], end and end["total_mib"])
        segments.append({"run": i, "baseline": base, "end": end, "growth": growth})
        note = "" if growth is not None else "no baseline or end sample"
        if base is not None and not base.get("kv_written_once"):
            note = "baseline taken before every KV page was written once: growth may "
            note += "include KV pages becoming resident"
        checks[f"rss_growth_run{i}"] = check(
            growth is not None and growth < max_growth, growth, max_growth, note=note
        )
    return segments, checks


def traffic_checks(
    records: list[Record], counts: dict[str, Any], kill_window: tuple[float, float] | None
) -> dict[str, dict[str, Any]]:
    """No failed request, no good input refused, every kind answered at least once as it
    should be, and (after a kill) an ok request that started once the server was back."""
    by_class = counts["by_class"]
    checks = {
        "no_failed_requests": check(by_class["failed"] == 0, by_class["failed"], 0),
        "no_unexpected_4xx": check(by_class["unexpected_4xx"] == 0, by_class["unexpected_4xx"], 0),
    }
    no_ok = [
        k
        for k in KINDS
        if not counts["by_kind"].get(k, {}).get("rejected_4xx" if k == "bad_input" else "ok")
    ]
    checks["every_kind_succeeded"] = check(not no_ok, no_ok or "all", note="kinds with none")
    if kill_window is not None:
        after = [r for r in records if r.ok and r.start >= kill_window[1]]
        checks["traffic_resumed_after_restart"] = check(bool(after), len(after), ">= 1")
    return checks


def mark_unexpected_exits(result: dict[str, Any]) -> None:
    """A server exit that was neither the kill's nor the final stop's."""
    kill_run = None
    if result.get("kill", {}).get("killed_s") is not None:
        kill_run = next(
            (
                r["run"]
                for r in result["server_runs"]
                if r["started_s"] <= result["kill"]["killed_s"] <= r.get("exited_s", float("inf"))
            ),
            None,
        )
    last = len(result["server_runs"]) - 1
    for r in result["server_runs"]:
        r["unexpected_exit"] = "exit_code" in r and r["run"] not in (kill_run, last)
