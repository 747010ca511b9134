"""benchmarks/soak.py and its parts (benchmarks/soak_parts/): request classes around the kill
window, counts, the metrics it reads, RSS growth, sample picking, log tails, the bad inputs it
sends, the checks, and the command line."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks.soak_parts.checks import mark_unexpected_exits, rss_checks, traffic_checks
from benchmarks.soak_parts.outcomes import Record, classify, tally
from benchmarks.soak_parts.payloads import BAD_INPUTS, bad_request
from benchmarks.soak_parts.report import log_tail
from benchmarks.soak_parts.rss import pick_samples, rss_growth
from benchmarks.soak_parts.server_probes import METRICS, is_idle, new_kv_tokens
from inferengine.bench.agent import parse_prometheus
from tests.conftest import load_script


@pytest.fixture(scope="module")
def cli():
    """benchmarks/soak.py, the script, loaded as a module (it puts benchmarks/ on sys.path)."""
    yield load_script("benchmarks/soak.py", register=True)
    sys.modules.pop("soak", None)


def test_classify_around_the_kill_window():
    R, window = Record, (50.0, 60.0)
    assert classify(R("chat_stream", 1, 2, ok=True), window) == "ok"
    # A good request failing with a 5xx or a dropped connection: excused only in the window.
    assert classify(R("completion", 48, 51, status=503), window) == "cut_by_kill"
    assert classify(R("completion", 55, 56, error="connect"), window) == "cut_by_kill"
    assert classify(R("completion", 59, 61, error="timeout"), window) == "cut_by_kill"
    assert classify(R("completion", 40, 49, status=500), window) == "failed"
    assert classify(R("completion", 61, 62, status=503), window) == "failed"
    assert classify(R("completion", 40, 49, status=500), None) == "failed"
    # A 4xx for a good input is never the kill's fault.
    assert classify(R("json_schema", 55, 56, status=400), window) == "unexpected_4xx"
    # Bad inputs: a 4xx is right, a 2xx or 5xx is a failure (outside the window).
    bad = dict(expect_4xx=True, variant="lone_surrogate_chat")
    assert classify(R("bad_input", 1, 2, status=400, **bad), window) == "rejected_4xx"
    assert classify(R("bad_input", 1, 2, status=413, **bad), window) == "rejected_4xx"
    assert classify(R("bad_input", 1, 2, status=500, **bad), window) == "failed"
    assert classify(R("bad_input", 1, 2, status=200, **bad), window) == "failed"
    assert classify(R("bad_input", 55, 56, error="connect", **bad), window) == "cut_by_kill"


def test_tally_counts_every_class_and_kind():
    R = Record
    records = [
        R("chat_stream", 1, 2, ok=True),
        R("chat_stream", 49, 51, status=503, error="stream_error", detail="engine died"),
        R("bad_input", 3, 4, status=500, expect_4xx=True, variant="lone_surrogate_chat"),
        R("bad_input", 3, 4, status=400, expect_4xx=True, variant="malformed_json"),
        R("completion", 70, 71, error="connect", detail="ConnectError"),
    ]
    out = tally(records, (50.0, 60.0))
    assert out["total"] == 5
    assert out["by_class"] == {
        "ok": 1,
        "rejected_4xx": 1,
        "unexpected_4xx": 0,
        "cut_by_kill": 1,
        "failed": 2,
    }
    assert out["by_kind"]["chat_stream"] == {"ok": 1, "cut_by_kill": 1}
    assert out["bad_inputs"] == {"lone_surrogate_chat": {"500": 1}, "malformed_json": {"400": 1}}
    assert {row["class"] for row in out["failure_table"]} == {"failed", "cut_by_kill"}
    assert sum(row["count"] for row in out["failure_table"]) == 3
    json.dumps(out)  # goes into results.json as is


def test_the_metrics_it_reads_are_summed_over_label_sets():
    """The agent benchmark's Prometheus reader with the soak's names: namespace dropped,
    gauges included."""
    text = "\n".join(
        [
            "# HELP inferengine:num_requests_running Requests in the running batch.",
            "# TYPE inferengine:num_requests_running gauge",
            'inferengine:num_requests_running{model_name="m"} 0.0',
            'inferengine:kv_cache_usage_perc{model_name="m"} 0.25',
            'inferengine:prompt_tokens_total{model_name="m",x="a"} 3.0',
            'inferengine:prompt_tokens_total{model_name="m",x="b"} 4.0',
            'inferengine:request_success_total{finished_reason="stop",model_name="m"} 3.0',
            "garbage line",
        ]
    )
    out = parse_prometheus(text, METRICS)
    assert out == {
        "num_requests_running": 0.0,
        "kv_cache_usage_perc": 0.25,
        "prompt_tokens_total": 7.0,
    }


def test_idle_needs_every_gauge_at_zero():
    metrics = {
        "num_requests_running": 0.0,
        "num_requests_waiting": 0.0,
        "kv_cache_usage_perc": 0.0,
    }
    stats = {"kv_pages_used": 0, "num_requests_in_flight": 0, "kv_pages_cached": 40}
    assert is_idle(metrics, stats)  # prefix-cached free pages are not held
    assert not is_idle({**metrics, "kv_cache_usage_perc": 0.01}, stats)
    assert not is_idle(metrics, {**stats, "kv_pages_used": 2})
    assert not is_idle(None, stats)
    assert not is_idle({}, stats)  # a gauge missing is not zero


def test_rss_growth_and_samples():
    assert rss_growth(1000.0, 1050.0) == 0.05
    assert rss_growth(None, 1050.0) is None
    assert rss_growth(1000.0, None) is None
    samples = [{"t_s": i} for i in range(100)]
    picked = pick_samples(samples, 12)
    assert len(picked) == 12 and picked[0]["t_s"] == 0 and picked[-1]["t_s"] == 99
    assert pick_samples(samples[:5], 12) == samples[:5]


def test_log_tail_keeps_the_end_small():
    text = "\n".join(f"line {i} " + "x" * (1000 if i == 995 else 10) for i in range(1000))
    tail = log_tail(text, lines=10, max_line=100, max_bytes=8000)
    lines = tail.splitlines()
    assert len(lines) == 10 and lines[-1].startswith("line 999")
    assert all(len(line) <= 106 for line in lines)
    assert len(log_tail(text, lines=1000, max_bytes=2000).encode()) <= 2001


def test_bad_inputs_are_what_they_say():
    for variant in BAD_INPUTS:
        path, raw = bad_request(variant, "m")
        assert path.startswith("/v1/")
        if variant == "malformed_json":
            with pytest.raises(ValueError):
                json.loads(raw)
            continue
        body = json.loads(raw)
        if variant.startswith("lone_surrogate"):
            text = json.dumps(body)  # the surrogate survives as an escape
            assert "\\ud800" in text or "\\udfff" in text
            with pytest.raises(UnicodeEncodeError):
                (body.get("prompt") or body["messages"][0]["content"]).encode("utf-8")
    assert len(bad_request("body_over_limit", "m")[1]) > 8 << 20


def test_args_defaults(cli):
    args = cli.parse_args([])
    assert args.duration_s == 600 and args.warmup_s == 60 and args.kill_at == 0.5
    assert args.server_args == cli.DEFAULT_SERVER_ARGS
    short = cli.parse_args(["--duration-s", "90", "--no-kill", "--server-arg=--seed=1"])
    assert short.warmup_s == 90 / 8 and short.kill_at is None
    assert short.server_args == ["--seed=1"]


def test_kv_tokens_written_and_block_size(cli):
    metrics = {
        "prompt_tokens_total": 1000.0,
        "prefix_cache_hits_total": 600.0,
        "generation_tokens_total": 250.0,
    }
    assert new_kv_tokens(metrics) == 650.0
    assert new_kv_tokens({}) == 0.0
    assert cli.parse_args([]).block_size == 16
    assert cli.parse_args(["--server-arg=--block-size=32"]).block_size == 32
    args = cli.parse_args(["--server-arg=--block-size", "--server-arg=8"])
    assert args.block_size == 8


def test_rss_checks_per_server_run():
    base = {"total_mib": 1000.0, "kv_written_once": True}
    early = {"total_mib": 1000.0, "kv_written_once": False}
    segments, checks = rss_checks([base, early], [{"total_mib": 1050.0}], 0.10)
    assert [s["growth"] for s in segments] == [0.05, None]
    assert checks["rss_growth_run0"] == {"pass": True, "value": 0.05, "limit": 0.10}
    run1 = checks["rss_growth_run1"]  # no end sample: a failure, noted
    assert not run1["pass"] and "before every KV page" in run1["note"]


def test_traffic_checks_and_unexpected_exits():
    records = [
        Record("chat_stream", 1, 2, ok=True),
        Record("bad_input", 3, 4, status=400, expect_4xx=True, variant="malformed_json"),
        Record("completion", 70, 71, ok=True),
    ]
    checks = traffic_checks(records, tally(records, (50.0, 60.0)), (50.0, 60.0))
    assert checks["no_failed_requests"]["pass"] and checks["no_unexpected_4xx"]["pass"]
    missing = checks["every_kind_succeeded"]
    assert not missing["pass"] and "chat_stream" not in missing["value"]
    assert "bad_input" not in missing["value"] and "json_schema" in missing["value"]
    assert checks["traffic_resumed_after_restart"] == {"pass": True, "value": 1, "limit": ">= 1"}
    assert "traffic_resumed_after_restart" not in traffic_checks(
        records, tally(records, None), None
    )
    result = {
        "kill": {"killed_s": 50.0},
        "server_runs": [
            {"run": 0, "started_s": 0.0, "exited_s": 51.0, "exit_code": 1},
            {"run": 1, "started_s": 52.0, "exited_s": 60.0, "exit_code": -9},
            {"run": 2, "started_s": 61.0, "exited_s": 90.0, "exit_code": 0},
        ],
    }
    mark_unexpected_exits(result)
    assert [r["unexpected_exit"] for r in result["server_runs"]] == [False, True, False]
