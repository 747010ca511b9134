"""benchmarks/soak.py's pure parts: request classes around the kill window, counts, metrics
text, RSS growth, sample picking, log tails and the bad inputs it sends."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", ROOT / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("soak", None)


def test_classify_around_the_kill_window(soak):
    R, window = soak.Record, (50.0, 60.0)
    assert soak.classify(R("chat_stream", 1, 2, ok=True), window) == "ok"
    # A good request failing with a 5xx or a dropped connection: excused only in the window.
    assert soak.classify(R("completion", 48, 51, status=503), window) == "cut_by_kill"
    assert soak.classify(R("completion", 55, 56, error="connect"), window) == "cut_by_kill"
    assert soak.classify(R("completion", 59, 61, error="timeout"), window) == "cut_by_kill"
    assert soak.classify(R("completion", 40, 49, status=500), window) == "failed"
    assert soak.classify(R("completion", 61, 62, status=503), window) == "failed"
    assert soak.classify(R("completion", 40, 49, status=500), None) == "failed"
    # A 4xx for a good input is never the kill's fault.
    assert soak.classify(R("json_schema", 55, 56, status=400), window) == "unexpected_4xx"
    # Bad inputs: a 4xx is right, a 2xx or 5xx is a failure (outside the window).
    bad = dict(expect_4xx=True, variant="lone_surrogate_chat")
    assert soak.classify(R("bad_input", 1, 2, status=400, **bad), window) == "rejected_4xx"
    assert soak.classify(R("bad_input", 1, 2, status=413, **bad), window) == "rejected_4xx"
    assert soak.classify(R("bad_input", 1, 2, status=500, **bad), window) == "failed"
    assert soak.classify(R("bad_input", 1, 2, status=200, **bad), window) == "failed"
    assert soak.classify(R("bad_input", 55, 56, error="connect", **bad), window) == "cut_by_kill"


def test_tally_counts_every_class_and_kind(soak):
    R = soak.Record
    records = [
        R("chat_stream", 1, 2, ok=True),
        R("chat_stream", 49, 51, status=503, error="stream_error", detail="engine died"),
        R("bad_input", 3, 4, status=500, expect_4xx=True, variant="lone_surrogate_chat"),
        R("bad_input", 3, 4, status=400, expect_4xx=True, variant="malformed_json"),
        R("completion", 70, 71, error="connect", detail="ConnectError"),
    ]
    out = soak.tally(records, (50.0, 60.0))
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


def test_parse_prometheus_sums_label_sets(soak):
    text = "\n".join(
        [
            "# HELP inferengine:num_requests_running Requests in the running batch.",
            "# TYPE inferengine:num_requests_running gauge",
            'inferengine:num_requests_running{model_name="m"} 0.0',
            'inferengine:kv_cache_usage_perc{model_name="m"} 0.25',
            'inferengine:request_success_total{finished_reason="stop",model_name="m"} 3.0',
            'inferengine:request_success_total{finished_reason="length",model_name="m"} 4.0',
            "garbage line",
        ]
    )
    out = soak.parse_prometheus(text)
    assert out["inferengine:num_requests_running"] == 0.0
    assert out["inferengine:kv_cache_usage_perc"] == 0.25
    assert out["inferengine:request_success_total"] == 7.0


def test_idle_needs_every_gauge_at_zero(soak):
    metrics = {
        "inferengine:num_requests_running": 0.0,
        "inferengine:num_requests_waiting": 0.0,
        "inferengine:kv_cache_usage_perc": 0.0,
    }
    stats = {"kv_pages_used": 0, "num_requests_in_flight": 0, "kv_pages_cached": 40}
    assert soak._idle(metrics, stats)  # prefix-cached free pages are not held
    assert not soak._idle({**metrics, "inferengine:kv_cache_usage_perc": 0.01}, stats)
    assert not soak._idle(metrics, {**stats, "kv_pages_used": 2})
    assert not soak._idle(None, stats)


def test_rss_growth_and_samples(soak):
    assert soak.rss_growth(1000.0, 1050.0) == 0.05
    assert soak.rss_growth(None, 1050.0) is None
    assert soak.rss_growth(1000.0, None) is None
    samples = [{"t_s": i} for i in range(100)]
    picked = soak.pick_samples(samples, 12)
    assert len(picked) == 12 and picked[0]["t_s"] == 0 and picked[-1]["t_s"] == 99
    assert soak.pick_samples(samples[:5], 12) == samples[:5]


def test_log_tail_keeps_the_end_small(soak):
    text = "\n".join(f"line {i} " + "x" * (1000 if i == 995 else 10) for i in range(1000))
    tail = soak.log_tail(text, lines=10, max_line=100, max_bytes=8000)
    lines = tail.splitlines()
    assert len(lines) == 10 and lines[-1].startswith("line 999")
    assert all(len(line) <= 106 for line in lines)
    assert len(soak.log_tail(text, lines=1000, max_bytes=2000).encode()) <= 2001


def test_bad_inputs_are_what_they_say(soak):
    for variant in soak.BAD_INPUTS:
        path, raw = soak.bad_request(variant, "m")
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
    assert len(soak.bad_request("body_over_limit", "m")[1]) > 8 << 20


def test_args_defaults(soak):
    args = soak.parse_args([])
    assert args.duration_s == 600 and args.warmup_s == 60 and args.kill_at == 0.5
    assert args.server_args == soak.DEFAULT_SERVER_ARGS
    short = soak.parse_args(["--duration-s", "90", "--no-kill", "--server-arg=--seed=1"])
    assert short.warmup_s == 90 / 8 and short.kill_at is None
    assert short.server_args == ["--seed=1"]


def test_kv_tokens_written_and_block_size(soak):
    metrics = {
        "inferengine:prompt_tokens_total": 1000.0,
        "inferengine:prefix_cache_hits_total": 600.0,
        "inferengine:generation_tokens_total": 250.0,
    }
    assert soak.new_kv_tokens(metrics) == 650.0
    assert soak.new_kv_tokens({}) == 0.0
    assert soak.parse_args([]).block_size == 16
    assert soak.parse_args(["--server-arg=--block-size=32"]).block_size == 32
    args = soak.parse_args(["--server-arg=--block-size", "--server-arg=8"])
    assert args.block_size == 8
