"""GPU utilization and memory sampled through NVML in a background thread, written as CSV."""

from __future__ import annotations

import csv
import threading
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Protocol

DEFAULT_INTERVAL_S = 0.2


@dataclass(frozen=True)
class GpuSample:
    t_s: float  # since the trace started (the server's launch)
    phase: str  # startup, warmup, benchmark, ...
    gpu: int
    util_pct: float
    mem_util_pct: float
    mem_used_mib: float
    mem_total_mib: float
    power_w: float | None


class Sampler(Protocol):
    def read(self) -> list[tuple[int, float, float, float, float, float | None]]: ...

    def close(self) -> None: ...


class NvmlSampler:
    """Every visible GPU's counters through `pynvml`; the constructor raises if NVML is missing."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())
        ]

    def read(self) -> list[tuple[int, float, float, float, float, float | None]]:
        nvml = self._nvml
        rows = []
        for i, h in enumerate(self._handles):
            util = nvml.nvmlDeviceGetUtilizationRates(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            try:
                power = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            except nvml.NVMLError:
                power = None
            rows.append((i, util.gpu, util.memory, mem.used / 2**20, mem.total / 2**20, power))
        return rows

    def describe(self) -> list[str]:
        """One line per GPU (name, memory), then the driver and the CUDA version it supports."""
        nvml = self._nvml
        lines = []
        for i, h in enumerate(self._handles):
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            lines.append(
                f"gpu {i}: {_text(nvml.nvmlDeviceGetName(h))}, {mem.total / 2**30:.1f} GiB"
            )
        lines.append(f"driver: {_text(nvml.nvmlSystemGetDriverVersion())}")
        try:
            cuda = nvml.nvmlSystemGetCudaDriverVersion()  # e.g. 13000 for 13.0
            lines.append(f"driver CUDA version: {cuda // 1000}.{cuda % 1000 // 10}")
        except nvml.NVMLError:
            pass
        return lines

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def describe_gpus() -> list[str]:
    """GPU names and driver, or why NVML could not tell."""
    try:
        sampler = NvmlSampler()
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, ...
        return [f"gpu: NVML unavailable: {type(e).__name__}: {e}"]
    try:
        return sampler.describe()
    finally:
        sampler.close()


class GpuTrace:
    """Samples every `interval_s` from `start()` to `stop()`; never raises when NVML is missing."""

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        sampler_factory: Callable[[], Sampler] = NvmlSampler,
    ) -> None:
        self.interval_s = interval_s
        self._factory = sampler_factory
        self.samples: list[GpuSample] = []
        self.started_at = time.time()  # wall clock of t_s == 0
        self.unavailable: str | None = None
        self._phase = "startup"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        try:
            sampler = self._factory()
        except Exception as e:
            self.unavailable = f"{type(e).__name__}: {e}"
            return
        self._thread = threading.Thread(target=self._loop, args=(sampler,), daemon=True)
        self._thread.start()

    def set_phase(self, phase: str) -> None:
        self._phase = phase

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self, sampler: Sampler) -> None:
        t0 = time.perf_counter()
        self.started_at = time.time()
        try:
            while not self._stop.is_set():
                tick = time.perf_counter()
                for row in sampler.read():
                    self.samples.append(GpuSample(tick - t0, self._phase, *row))
                self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - tick)))
        except Exception as e:  # a GPU that falls off the bus must not kill the benchmark
            self.unavailable = f"sampling stopped: {type(e).__name__}: {e}"
        finally:
            sampler.close()

    def write_csv(self, path: Path) -> None:
        with open(path, "w", newline="", encoding="utf-8") as f:
            if self.unavailable:
                f.write(f"# NVML unavailable: {self.unavailable}\n")
            writer = csv.writer(f)
            writer.writerow([fl.name for fl in fields(GpuSample)])
            for s in self.samples:
                writer.writerow(["" if v is None else v for v in astuple(s)])

    def busy_between(self, start: float, end: float) -> float | None:
        """Mean utilization (%) of the samples taken between two wall-clock times, e.g. a
        client's measured window; None with fewer than two samples there."""
        lo, hi = start - self.started_at, end - self.started_at
        values = [s.util_pct for s in list(self.samples) if lo <= s.t_s <= hi]
        return round(sum(values) / len(values), 2) if len(values) >= 2 else None

    def phases(self) -> dict[str, dict]:
        """Per phase: its length, how busy the GPUs were (NVML's utilization is the share of
        time a kernel ran; mean over GPUs, and each GPU's when there are several) and the peak
        memory of one GPU, in the order the phases began."""
        grouped: dict[str, list[GpuSample]] = {}
        for s in self.samples:
            grouped.setdefault(s.phase, []).append(s)
        out = {}
        for phase, rows in grouped.items():
            per_gpu: dict[int, list[float]] = {}
            for r in rows:
                per_gpu.setdefault(r.gpu, []).append(r.util_pct)
            entry = {
                "seconds": round(rows[-1].t_s - rows[0].t_s + self.interval_s, 3),
                "samples": len(rows) // len(per_gpu),
                "busy_pct": round(sum(r.util_pct for r in rows) / len(rows), 2),
                "peak_mem_used_mib": round(max(r.mem_used_mib for r in rows), 1),
            }
            if len(per_gpu) > 1:
                entry["busy_pct_per_gpu"] = {
                    g: round(sum(v) / len(v), 2) for g, v in sorted(per_gpu.items())
                }
            out[phase] = entry
        return out

    def summary(self) -> dict:
        """Sample count, mean utilization per phase and peak memory, for comparison.json."""
        by_phase: dict[str, list[float]] = {}
        for s in self.samples:
            by_phase.setdefault(s.phase, []).append(s.util_pct)
        return {
            "available": self.unavailable is None,
            "unavailable_reason": self.unavailable,
            "num_samples": len(self.samples),
            "mean_util_pct": {p: sum(v) / len(v) for p, v in by_phase.items()},
            "peak_mem_used_mib": max((s.mem_used_mib for s in self.samples), default=None),
        }
