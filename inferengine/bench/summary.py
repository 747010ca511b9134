"""Repeated paired runs reduced to what a reader quotes: per workload and system, every run's
numbers, their median and range, the ratio of the medians, and the gates over those medians."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from inferengine.bench.gates import HEADLINE_METRICS, Gate, evaluate_gate, metric_value, ratio

RUN_METRICS = (
    *(m for m in HEADLINE_METRICS if m != "ready_s"),
    "mean_ttft_ms",
    "mean_tpot_ms",
    "mean_itl_ms",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
)


def run_metrics(result: Mapping | None) -> dict[str, float | None]:
    """The numbers of one client result that the summary keeps."""
    return {m: metric_value(result, m) for m in RUN_METRICS}


def spread(values: Sequence[float | None]) -> dict:
    """Median, min and max of the measured values, and how many runs measured it."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


def system_summary(runs: Sequence[Mapping], metrics: Sequence[str]) -> dict:
    """Every metric's spread over this system's runs of one workload."""
    return {m: spread([r["metrics"].get(m) for r in runs]) for m in metrics}


def workload_summary(
    systems: Sequence[str],
    runs: Sequence[Mapping],
    ready: Mapping[str, dict],
    gates: Sequence[Gate],
    workload: str,
) -> dict:
    """One workload: each system's runs and spreads, the ratios of medians, the gates."""
    metrics = [*RUN_METRICS, "busy_pct"]
    by_system = {
        name: {
            "runs": [r for r in runs if r["system"] == name],
            "spread": system_summary([r for r in runs if r["system"] == name], metrics),
        }
        for name in systems
    }
    medians: dict[str, dict[str, float | None]] = {
        name: {m: s["median"] for m, s in entry["spread"].items()}
        for name, entry in by_system.items()
    }
    for name in systems:
        medians[name]["ready_s"] = ready.get(name, {}).get("median")
    ratios = {}
    if len(systems) >= 2:
        a, b = systems[0], systems[1]
        ratios = {
            m: ratio(medians[a].get(m), medians[b].get(m)) for m in [*HEADLINE_METRICS, "busy_pct"]
        }
    mine = [g for g in gates if g.workload in (None, workload)]
    verdicts = [evaluate_gate(g, medians, systems) for g in mine]
    return {
        "systems": by_system,
        "ratios": ratios,
        "ratio_of": f"{systems[0]}/{systems[1]}" if len(systems) >= 2 else None,
        "gates": verdicts,
        "same_output_lens": same_output_lens(by_system),
    }


def same_output_lens(by_system: Mapping[str, Mapping]) -> dict[str, list[bool]] | None:
    """Per system and run, whether its per-request output lengths equal those of the first
    system's first run (greedy workloads: speculation and plain decoding should agree); None
    when that run has no digest."""
    runs = next(iter(by_system.values()), {}).get("runs") or [{}]
    reference = runs[0].get("output_lens_digest")
    if reference is None:
        return None
    return {
        name: [r.get("output_lens_digest") == reference for r in entry["runs"]]
        for name, entry in by_system.items()
    }


def format_summary(summary: Mapping) -> str:
    """Per workload, a plain table of medians with [min-max] over the runs, then the gates."""
    systems = summary["systems"]
    lines = [f"judge: {summary['judge']}; runs per system: {summary['runs_per_system']}"]
    for name, w in summary["workloads"].items():
        lines += ["", f"== {name}: {w['description']}"]
        head = f"{'metric':<22}" + "".join(f"{s[:26]:>28}" for s in systems) + f"{'ratio':>8}"
        lines += [head, "-" * len(head)]
        for metric in (*HEADLINE_METRICS, "busy_pct"):
            if metric == "ready_s":
                continue
            cells = "".join(_cell(w["systems"][s]["spread"].get(metric, {})) for s in systems)
            r = w["ratios"].get(metric)
            lines.append(f"{metric:<22}{cells}{'' if r is None else f'{r:8.3f}'}")
        floor = w.get("floor")
        if floor and floor.get("floor_ms"):
            over = ", ".join(f"{s} {v:.3f}x" for s, v in floor["tpot_over_floor"].items() if v)
            lines.append(f"bandwidth floor {floor['floor_ms']:.3f} ms/token; median TPOT: {over}")
        lines += _alone_and_mfu_lines(w)
        for v in w["gates"]:
            value = "n/a" if v["value"] is None else f"{v['value']:.4g}"
            why = f" ({v['error']})" if v["error"] else ""
            status = "PASS" if v["passed"] else "FAIL"
            lines.append(f"gate {status}: {v['gate']}  [{v['target']} = {value}]{why}")
    ready = summary["ready_s"]
    lines += ["", "ready after launch (s): " + "; ".join(
        f"{s} {_span(ready[s])}" for s in systems
    )]  # fmt: skip
    return "\n".join(lines)


def _span(s: Mapping) -> str:
    if not s or s.get("median") is None:
        return "-"
    if s["n"] == 1:
        return f"{s['median']:.2f}"
    return f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def _cell(s: Mapping) -> str:
    return f"{_span(s):>28}"


def _alone_and_mfu_lines(w: Mapping) -> list[str]:
    """A system measured alone beside its harness figure; the prefill MFU per system."""
    lines = []
    for of, ratios in (w.get("harness_vs_alone") or {}).items():
        alone = w["alone"][f"{of}-alone"]["spread"]
        cells = ", ".join(
            f"{m} {_span(alone[m])} (harness/alone {r:.3f})"
            for m, r in ratios.items()
            if r is not None
        )
        lines.append(f"{of} alone: {cells or '-'}")
    mfu = w.get("mfu") or {}
    if mfu.get("peak_bf16_matmul_tflops_per_gpu"):
        cells = ", ".join(
            f"{name} {_span(v['mfu_pct'])}" for name, v in mfu.items() if isinstance(v, dict)
        )
        peak = mfu["peak_bf16_matmul_tflops_per_gpu"]
        lines.append(f"MFU, % of the measured bf16 matmul peak of {peak:.0f} TFLOP/s: {cells}")
    return lines
