"""Profile decode steps on the GPU: where a step's time goes, host and device.

Runs `--batch` requests to a steady decode state on a dummy-weight model, then times
`--steps` pipelined engine steps (as served: the per-token time), then `--steps` synchronous
steps phase by phase (schedule, execute, update), and profiles those with the
torch profiler. Kernel time is split into matmuls, attention and everything else. Writes
`benchmarks/results/<UTC stamp>-decode-profile/` with results.json and a gzipped Chrome trace.

    python benchmarks/decode_profile.py [--model configs/qwen2.5-7b] [--batch 16]
        [--quantization fp8 --kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

MATMUL_MARKERS = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "matmul", "sm90_", "splitk")
ATTENTION_MARKERS = ("paged_attention", "merge_splits", "store_kv", "flash", "attention")


def kernel_category(name: str) -> str:
    lowered = name.lower()
    if any(m in lowered for m in ATTENTION_MARKERS):
        return "attention"
    if any(m in lowered for m in MATMUL_MARKERS):
        return "matmul"
    return "other"


def timed_step(core) -> dict[str, float]:
    t0 = time.perf_counter()
    so = core.scheduler.schedule()
    t1 = time.perf_counter()
    out = core.executor.execute_model(so)
    t2 = time.perf_counter()
    core.scheduler.update_from_output(so, out)
    t3 = time.perf_counter()
    return {
        "schedule_ms": (t1 - t0) * 1e3,
        "execute_ms": (t2 - t1) * 1e3,
        "update_ms": (t3 - t2) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/qwen2.5-7b")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--profile-steps", type=int, default=10)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--quantization", default=None, help="e.g. fp8")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    from inferengine import LLM, SamplingParams

    llm = LLM(
        args.model,
        load_format="dummy",
        max_model_len=4096,
        max_num_seqs=max(args.batch, 16),
        enforce_eager=args.enforce_eager,
        gpu_memory_utilization=0.85,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = llm.llm_engine
    core = engine.core
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(0, 30000, (args.prompt_len,), generator=g).tolist()
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params)
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()
    for _ in range(10):  # warm decode steps
        core.step()
    torch.cuda.synchronize()

    # Pipelined steps as the server runs them (async scheduling: step N+1 is launched before
    # step N's tokens are read), so host work hides behind the GPU: the per-token time.
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    torch.cuda.synchronize()
    pipelined_ms = (time.perf_counter() - start) * 1e3 / args.steps
    while core._inflight:  # settle: the synchronous steps below start clean
        core._collect(False)
    phases = [timed_step(core) for _ in range(args.steps)]
    step_ms = [sum(p.values()) for p in phases]
    trace_dir = Path(tempfile.mkdtemp())
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.profile_steps):
            timed_step(core)
        torch.cuda.synchronize()
    trace = trace_dir / "trace.json"
    prof.export_chrome_trace(str(trace))

    kernels: dict[str, float] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if device_us and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.key] = kernels.get(event.key, 0.0) + device_us
    by_category = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for name, us in kernels.items():
        by_category[kernel_category(name)] += us
    gpu_ms_per_step = sum(by_category.values()) / 1e3 / args.profile_steps
    median_step = statistics.median(step_ms)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    results = {
        "model": args.model,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "cuda_graphs": not args.enforce_eager,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "gpu": torch.cuda.get_device_name(),
        "pipelined_step_ms": pipelined_ms,
        "steps_in_flight": core.depth,
        "pdl": os.environ.get("INFERENGINE_PDL", "1") != "0",
        "median_step_ms": median_step,
        "median_phase_ms": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "gpu_kernel_ms_per_step": gpu_ms_per_step,
        "host_ms_per_step_not_covered_by_gpu": max(0.0, median_step - gpu_ms_per_step),
        "gpu_share": {k: v / max(sum(by_category.values()), 1e-9) for k, v in by_category.items()},
        "top_kernels_ms_per_step": {k: v / 1e3 / args.profile_steps for k, v in top},
        "step_ms_all": step_ms,
    }
    folder = write_result_folder("decode-profile", results, args.out_dir)
    with open(trace, "rb") as src, gzip.open(folder / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    print(
        f"pipelined step {pipelined_ms:.3f} ms; synchronous step {median_step:.3f} ms; "
        f"GPU kernels {gpu_ms_per_step:.3f} ms/step"
    )
    for k, v in results["gpu_share"].items():
        print(f"  {k:<10} {v * 100:5.1f}% of GPU time")
    print(f"  phases (median ms): {results['median_phase_ms']}")
    print(f"results: {folder}")


if __name__ == "__main__":
    main()
