"""`bench plot`: output throughput bars, TTFT and ITL distributions and GPU use, as small PNGs."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np

from inferengine.errors import ConfigError

DPI = 100
FIGSIZE = (6.4, 4.0)


def load_results(result_dir: Path) -> dict[str, dict]:
    """System name -> our client's result, in the paired order when comparison.json is there."""
    comparison = result_dir / "comparison.json"
    if comparison.exists():
        runs = json.loads(comparison.read_text(encoding="utf-8")).get("runs", {})
        files = {name: run.get("result_file") for name, run in runs.items()}
    else:
        files = {p.stem: p.name for p in sorted(result_dir.glob("*.json"))}
    results = {}
    for name, file in files.items():
        if not file or not (result_dir / file).exists():
            continue
        data = json.loads((result_dir / file).read_text(encoding="utf-8"))
        if isinstance(data, dict) and "output_throughput" in data:
            results[name] = data
    return results


def _successful(result: dict, key: str) -> list[Any]:
    errors = result.get("errors") or [""] * len(result.get(key) or [])
    return [v for v, e in zip(result.get(key) or [], errors, strict=False) if not e]


def _cdf(ax: Any, values_ms: np.ndarray, label: str) -> None:
    if values_ms.size == 0:
        return
    x = np.sort(values_ms)
    ax.step(x, np.arange(1, x.size + 1) / x.size, where="post", label=label)


def plot_throughput(results: dict[str, dict], result_dir: Path, plt: Any) -> Path:
    names = list(results)
    ours = [results[n]["output_throughput"] for n in names]
    vllm = [_vllm_value(result_dir, n, "output_throughput") for n in names]
    fig, ax = plt.subplots(figsize=FIGSIZE)
    x = np.arange(len(names))
    if any(v is not None for v in vllm):
        width = 0.4
        bars = ax.bar(x - width / 2, ours, width, label="our client")
        theirs = ax.bar(x + width / 2, [v or 0.0 for v in vllm], width, label="vLLM client")
        ax.bar_label(theirs, fmt="%.0f")
        ax.legend(loc="lower right")
    else:
        bars = ax.bar(x, ours, 0.6)
    ax.bar_label(bars, fmt="%.0f")
    ax.set_xticks(x, names)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput")
    return _save(fig, result_dir / "throughput.png", plt)


def plot_latency_cdf(results: dict[str, dict], result_dir: Path, metric: str, plt: Any) -> Path:
    """CDF of TTFT (`ttfts`) or ITL (`itls`, every gap of every request) per system."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    x_max = 0.0
    for name, result in results.items():
        values = _successful(result, f"{metric}s")
        if metric == "itl":
            values = [gap for gaps in values for gap in gaps]
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        median = f"median {np.median(ms):.2f} ms" if ms.size else "no data"
        _cdf(ax, ms, f"{name} ({median})")
        if ms.size:
            x_max = max(x_max, float(np.percentile(ms, 99.5)))
    if x_max > 0:  # a few stalls would squash the curves; the median is in the legend
        ax.set_xlim(0, x_max * 1.05)
    ax.set_xlabel(f"{metric.upper()} (ms, cut at the 99.5th percentile)")
    ax.set_ylabel("fraction of " + ("requests" if metric == "ttft" else "gaps"))
    ax.set_title(f"{metric.upper()} distribution")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, result_dir / f"{metric}_cdf.png", plt)


def plot_gpu(result_dir: Path, names: list[str], plt: Any) -> Path | None:
    """GPU utilization over time per system, if any trace has samples."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    drawn = False
    for name in names:
        path = result_dir / f"{name}-gpu.csv"
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as f:
            rows = list(csv.DictReader(line for line in f if not line.startswith("#")))
        rows = [r for r in rows if r.get("gpu") == "0"]
        if rows:
            t = [float(r["t_s"]) for r in rows]
            ax.plot(t, [float(r["util_pct"]) for r in rows], label=name, linewidth=1)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("seconds since launch")
    ax.set_ylabel("GPU 0 utilization (%)")
    ax.set_title("GPU utilization")
    ax.legend()
    return _save(fig, result_dir / "gpu_util.png", plt)


def plot_results(result_dir: Path) -> list[Path]:
    """Every plot for a result folder; returns the PNGs written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = load_results(result_dir)
    if not results:
        raise ConfigError(f"no benchmark result JSON in {result_dir}")
    written = [
        plot_throughput(results, result_dir, plt),
        plot_latency_cdf(results, result_dir, "ttft", plt),
        plot_latency_cdf(results, result_dir, "itl", plt),
    ]
    gpu = plot_gpu(result_dir, list(results), plt)
    return written + ([gpu] if gpu else [])


def _vllm_value(result_dir: Path, name: str, key: str) -> float | None:
    path = result_dir / f"{name}-vllm.json"
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get(key)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
