"""Headline comparison of paired runs, and pass/fail gates over it.

Gate grammar (one `--gate` each):

    GATE   := [ WORKLOAD ":" ] METRIC OP NUMBER [ "@" TARGET ]
    OP     := ">=" | "<=" | ">" | "<" | "=="
    TARGET := SYSTEM              the absolute value measured for SYSTEM
            | SYSTEM "/" SYSTEM   the ratio of the two systems' values
    no TARGET                     the ratio FIRST/SECOND of the first two --system given
    no WORKLOAD                   the gate holds for every workload of the run

Values are the medians over the repeats of the judge's numbers.

METRIC is a headline metric (output_throughput, request_throughput, total_token_throughput,
median_/p99_ of ttft_ms, itl_ms, tpot_ms, e2el_ms, and ready_s: seconds from launch to /health)
or any numeric field of a result JSON, e.g. `mean_ttft_ms` or `failed`. Examples: `output_throughput>=1.05` (the first system has at least
1.05x the second's output throughput), `w1:median_itl_ms<=6.0@A`, `p99_ttft_ms<=1.1@A/vllm`.
A gate whose value cannot be computed (a system failed, a metric is missing) fails.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from inferengine.errors import ConfigError

# metric -> which direction is better
HEADLINE_METRICS: dict[str, str] = {
    "output_throughput": "higher",
    "request_throughput": "higher",
    "total_token_throughput": "higher",
    **{
        f"{stat}_{name}_ms": "lower"
        for name in ("ttft", "itl", "tpot", "e2el")
        for stat in ("median", "p99")
    },
    "ready_s": "lower",
}

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
}

_GATE_RE = re.compile(
    r"^\s*(?:(?P<workload>[A-Za-z0-9_.-]+)\s*:)?\s*(?P<metric>[A-Za-z_][\w.]*)\s*(?P<op>>=|<=|==|>|<)\s*(?P<num>[-+]?[\d.]+(?:[eE][-+]?\d+)?)"
    r"\s*(?:@\s*(?P<sys>[^/\s]+)\s*(?:/\s*(?P<other>[^/\s]+))?)?\s*$"
)

# system name -> metric name -> value (None when it could not be measured)
Values = Mapping[str, Mapping[str, float | None]]


@dataclass(frozen=True)
class Gate:
    expr: str
    metric: str
    op: str
    threshold: float
    system: str | None = None  # absolute value of this system, or numerator of a ratio
    other: str | None = None  # denominator of a ratio
    workload: str | None = None  # None: every workload


def parse_gate(expr: str) -> Gate:
    m = _GATE_RE.match(expr)
    if not m:
        raise ConfigError(
            f"cannot read gate {expr!r}; write [WORKLOAD:]METRIC OP NUMBER[@SYSTEM[/SYSTEM]], "
            "e.g. output_throughput>=1.05 or w1:median_itl_ms<=6.0@A"
        )
    return Gate(expr, m["metric"], m["op"], float(m["num"]), m["sys"], m["other"], m["workload"])


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def metric_value(result: Mapping | None, metric: str) -> float | None:
    """A numeric field of a result, or None."""
    value = (result or {}).get(metric)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return None
    return float(value)


def evaluate_gate(gate: Gate, values: Values, order: Sequence[str]) -> dict:
    """The gate's target, the value it measured and whether it passed."""
    if gate.system is None:
        if len(order) < 2:
            return _verdict(gate, "ratio", None, "a ratio gate needs two systems")
        num, den = order[0], order[1]
    else:
        num, den = gate.system, gate.other
    for name in (num, den):
        if name is not None and name not in values:
            return _verdict(gate, name, None, f"no system named {name!r}")
    if den is None:
        target, value = num, values[num].get(gate.metric)
    else:
        target, value = (
            f"{num}/{den}",
            ratio(values[num].get(gate.metric), values[den].get(gate.metric)),
        )
    if value is None:
        return _verdict(gate, target, None, f"{gate.metric} was not measured for {target}")
    return _verdict(gate, target, value, None)


def _verdict(gate: Gate, target: str, value: float | None, error: str | None) -> dict:
    passed = value is not None and OPERATORS[gate.op](value, gate.threshold)
    return {
        "gate": gate.expr,
        "target": target,
        "metric": gate.metric,
        "op": gate.op,
        "threshold": gate.threshold,
        "value": value,
        "passed": passed,
        "error": error,
    }


def collect_values(
    order: Sequence[str],
    results: Mapping[str, Mapping | None],
    ready_s: Mapping[str, float | None],
    extra_metrics: Sequence[str] = (),
) -> dict[str, dict[str, float | None]]:
    """Per system, every headline metric plus `extra_metrics` (ready_s from the launch)."""
    names = list(HEADLINE_METRICS) + [m for m in extra_metrics if m not in HEADLINE_METRICS]
    values: dict[str, dict[str, float | None]] = {}
    for name in order:
        values[name] = {m: metric_value(results.get(name), m) for m in names}
        values[name]["ready_s"] = ready_s.get(name)
    return values


def build_comparison(order: Sequence[str], values: Values, gates: Sequence[Gate]) -> dict:
    """The `metrics` (each system's value, FIRST/SECOND ratio, better direction) and `gates`."""
    metrics = {}
    for metric, better in HEADLINE_METRICS.items():
        entry: dict = {"better": better, "values": {n: values[n].get(metric) for n in order}}
        if len(order) >= 2:
            entry["ratio"] = ratio(values[order[0]].get(metric), values[order[1]].get(metric))
            entry["ratio_of"] = f"{order[0]}/{order[1]}"
            entry["ratio_better_when"] = "above 1" if better == "higher" else "below 1"
        metrics[metric] = entry
    verdicts = [evaluate_gate(g, values, order) for g in gates]
    return {
        "systems": list(order),
        "metrics": metrics,
        "gates": verdicts,
        "gates_passed": all(v["passed"] for v in verdicts),
    }


def format_comparison(comparison: dict) -> str:
    """A plain table: metric, each system's value, the ratio; then the gates."""
    order = comparison["systems"]
    head = f"{'metric':<24}" + "".join(f"{n[:14]:>15}" for n in order) + f"{'ratio':>9}  better"
    lines = [head, "-" * len(head)]
    for metric, entry in comparison["metrics"].items():
        cells = "".join(_cell(entry["values"][n]) for n in order)
        r = entry.get("ratio")
        lines.append(f"{metric:<24}{cells}{'' if r is None else f'{r:9.3f}':>9}  {entry['better']}")
    for v in comparison["gates"]:
        status = "PASS" if v["passed"] else "FAIL"
        value = "n/a" if v["value"] is None else f"{v['value']:.4g}"
        why = f" ({v['error']})" if v["error"] else ""
        lines.append(f"gate {status}: {v['gate']}  [{v['target']} = {value}]{why}")
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return f"{'-':>15}" if value is None else f"{value:15.2f}"
