"""`bench plot`: one small PNG of a paired folder — every run's judge numbers, per workload.

Each panel is a workload and a metric (output throughput, median ITL, median TTFT); each dot
one run, x the system, the bar the median. Every run is drawn, not only the best.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inferengine.errors import ConfigError

DPI = 72
PANELS = (
    ("output_throughput", "output tok/s"),
    ("median_itl_ms", "median ITL (ms)"),
    ("median_ttft_ms", "median TTFT (ms)"),
)


def load_summary(result_dir: Path) -> dict:
    path = result_dir / "summary.json"
    if not path.exists():
        raise ConfigError(
            f"{result_dir} has no summary.json; `bench plot` draws folders of `bench paired` "
            "(folders written before repeated runs keep their comparison.json only)"
        )
    return json.loads(path.read_text(encoding="utf-8"))


def plot_results(result_dir: Path) -> list[Path]:
    """`runs.png` in the folder; returns the PNGs written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = load_summary(result_dir)
    systems, workloads = summary["systems"], summary["workloads"]
    if not workloads:
        raise ConfigError(f"{result_dir}/summary.json has no workloads")
    cols = len(workloads)
    fig, axes = plt.subplots(
        len(PANELS), cols, figsize=(2.4 * cols + 0.6, 2.0 * len(PANELS)), squeeze=False
    )
    for col, (name, workload) in enumerate(workloads.items()):
        for row, (metric, label) in enumerate(PANELS):
            _panel(axes[row][col], systems, workload, metric)
            if col == 0:
                axes[row][col].set_ylabel(label, fontsize=8)
        axes[0][col].set_title(name, fontsize=9)
    fig.suptitle(f"{summary['judge']}: every run, bar = median", fontsize=9)
    fig.tight_layout()
    path = result_dir / "runs.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return [path]


def _panel(ax: Any, systems: list[str], workload: dict, metric: str) -> None:
    for x, system in enumerate(systems):
        entry = workload["systems"].get(system, {})
        values = [r["metrics"].get(metric) for r in entry.get("runs", [])]
        values = [v for v in values if v is not None]
        median = entry.get("spread", {}).get(metric, {}).get("median")
        if median is not None:
            ax.bar(x, median, 0.6, alpha=0.35)
        ax.plot([x] * len(values), values, "o", markersize=3, color="black")
    ax.set_xticks(range(len(systems)), [s[:10] for s in systems], fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="y", alpha=0.3)
