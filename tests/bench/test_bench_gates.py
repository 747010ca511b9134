"""Gate grammar and evaluation, and the headline comparison of paired runs."""

from __future__ import annotations

import pytest

from inferengine.bench.gates import (
    build_comparison,
    collect_values,
    evaluate_gate,
    format_comparison,
    parse_gate,
)
from inferengine.errors import ConfigError

RESULTS = {
    "A": {"output_throughput": 1100.0, "median_itl_ms": 5.5, "p99_ttft_ms": 40.0, "failed": 0},
    "B": {"output_throughput": 1000.0, "median_itl_ms": 6.0, "p99_ttft_ms": 50.0, "failed": 2},
    "C": None,  # did not run
}
ORDER = ["A", "B", "C"]


def values(extra=()):
    return collect_values(ORDER, RESULTS, {"A": 12.0, "B": 80.0, "C": None}, extra)


def check(expr: str) -> dict:
    gate = parse_gate(expr)
    return evaluate_gate(gate, values([gate.metric]), ORDER)


def test_parse():
    g = parse_gate(" median_itl_ms <= 6.0 @ A ")
    assert (g.metric, g.op, g.threshold, g.system, g.other) == (
        "median_itl_ms",
        "<=",
        6.0,
        "A",
        None,
    )
    g = parse_gate("p99_ttft_ms<1e2@A/B")
    assert (g.op, g.threshold, g.system, g.other) == ("<", 100.0, "A", "B")
    for bad in ("throughput", "x>>1", "x>=", "x>=1@", "x>=1@A/B/C", ">=1"):
        with pytest.raises(ConfigError):
            parse_gate(bad)


def test_ratio_of_first_to_second_by_default():
    v = check("output_throughput>=1.05")
    assert v["passed"] and v["target"] == "A/B" and v["value"] == pytest.approx(1.1)
    assert not check("output_throughput>=1.2")["passed"]
    assert check("median_itl_ms<=0.95")["passed"]  # 5.5 / 6.0


def test_absolute_and_named_ratio():
    assert check("median_itl_ms<=6.0@A")["passed"]
    assert not check("median_itl_ms<6.0@B")["passed"]
    assert check("ready_s<20@A")["passed"]
    assert check("p99_ttft_ms<=0.8@A/B")["passed"]
    assert check("failed==0@A")["passed"]  # any numeric field of a result
    assert not check("failed==0@B")["passed"]


def test_unmeasurable_gates_fail_with_a_reason():
    for expr, why in (
        ("output_throughput>=1@C", "not measured"),
        ("output_throughput>=1@A/C", "not measured"),
        ("output_throughput>=1@D", "no system"),
        ("no_such_metric>=1@A", "not measured"),
    ):
        v = check(expr)
        assert not v["passed"] and v["value"] is None and why in v["error"], expr


def test_comparison_lists_values_ratios_and_directions():
    gates = [parse_gate("output_throughput>=1.05"), parse_gate("median_itl_ms<=5@A")]
    comparison = build_comparison(ORDER, values(), gates)
    thr = comparison["metrics"]["output_throughput"]
    assert thr["values"] == {"A": 1100.0, "B": 1000.0, "C": None}
    assert thr["ratio"] == pytest.approx(1.1) and thr["ratio_of"] == "A/B"
    assert thr["better"] == "higher" and thr["ratio_better_when"] == "above 1"
    assert comparison["metrics"]["median_ttft_ms"]["better"] == "lower"
    assert comparison["metrics"]["ready_s"]["ratio"] == pytest.approx(12.0 / 80.0)
    assert [g["passed"] for g in comparison["gates"]] == [True, False]
    assert comparison["gates_passed"] is False
    text = format_comparison(comparison)
    assert "output_throughput" in text and "gate FAIL: median_itl_ms<=5@A" in text
