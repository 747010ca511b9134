"""All-reduce latency on the GPUs of one host: NCCL against CustomAllReduce, eager and in CUDA graphs.

One process per GPU (NCCL; NVLink multicast off in NCCL, torch and NVSHMEM). For each message size (bf16, 8 KiB to 64 MiB
by default) it times `dist.all_reduce` and `CustomAllReduce.all_reduce`, each run eagerly and
replayed from a CUDA graph of `--graph-calls` calls, with CUDA events: the median over
`--repeats` timings, the slowest rank's. Rank 0 writes a result folder
(`benchmarks/results/<UTC stamp>-all-reduce-latency/` or `--out-dir`) whose results.json holds,
per size, `nccl_us`, `custom_us`, `nccl_graph_us`, `custom_graph_us` and `chosen` (what
`tp_all_reduce` picks with the default limit).

    python benchmarks/all_reduce_latency.py [--world-size 2] [--max-bytes 64MiB]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

KIB = 1 << 10
MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def parse_bytes(text: str) -> int:
    units = {"kib": KIB, "mib": KIB * KIB, "gib": KIB**3, "b": 1}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * scale)
    return int(lowered)


def message_sizes(smallest: int, largest: int, step: int) -> list[int]:
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= step
    return sizes


def _median_us(run, calls: int, repeats: int) -> float:
    """Median microseconds per call over `repeats` timings of `run` (which makes `calls`)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def time_eager(fn, iters: int, repeats: int) -> float:
    """Median microseconds per call of `fn`, launched back to back."""

    def run() -> None:
        for _ in range(iters):
            fn()

    return _median_us(run, iters, repeats)


def time_graph(fn, calls: int, repeats: int) -> float:
    """Median microseconds per call of `fn`, `calls` of them captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: NCCL's watchdog thread may query events while this thread captures.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    graph.replay()  # first replay uploads the graph
    median = _median_us(graph.replay, calls, repeats)
    del graph
    torch.cuda.synchronize()
    return median


def slowest_rank(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def measure(args: argparse.Namespace, rank: int, device: torch.device) -> dict:
    from inferengine.distributed.custom_all_reduce import DEFAULT_MAX_BYTES, CustomAllReduce

    sizes = message_sizes(args.min_bytes, args.max_bytes, args.step)
    # Built for every measured size, so that the table also shows the custom path where the
    # default limit would hand the message to NCCL.
    custom = CustomAllReduce.create(dist.group.WORLD, device, max_bytes=max(sizes))
    rows = {}
    for size in sizes:
        x = torch.zeros(size // 2, dtype=torch.bfloat16, device=device)
        row = {
            "nccl_us": time_eager(lambda x=x: dist.all_reduce(x), args.iters, args.repeats),
            "nccl_graph_us": time_graph(
                lambda x=x: dist.all_reduce(x), args.graph_calls, args.repeats
            ),
        }
        usable = custom is not None and custom.should_use(x)
        if usable:
            row["custom_us"] = time_eager(
                lambda x=x: custom.all_reduce(x), args.iters, args.repeats
            )
            row["custom_graph_us"] = time_graph(
                lambda x=x: custom.all_reduce(x), args.graph_calls, args.repeats
            )
        keys = sorted(row)
        row = dict(zip(keys, slowest_rank([row[k] for k in keys], device), strict=True))
        row = {k: round(v, 2) for k, v in row.items()}
        row["chosen"] = "custom" if usable and size <= DEFAULT_MAX_BYTES else "nccl"
        rows[label(size)] = row
        del x
        torch.cuda.empty_cache()
        if rank == 0:
            print(label(size), row, flush=True)
    wins = [s for s in sizes if _custom_wins(rows[label(s)])]
    return {
        "custom": custom.name if custom is not None else None,
        "default_max_bytes": DEFAULT_MAX_BYTES,
        "custom_graph_faster_up_to": label(max(wins)) if wins else None,
        "sizes": rows,
    }


def _custom_wins(row: dict) -> bool:
    return "custom_graph_us" in row and row["custom_graph_us"] < row["nccl_graph_us"]


def label(size: int) -> str:
    return f"{size // KIB} KiB" if size < KIB * KIB else f"{size // (KIB * KIB)} MiB"


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device
    )
    try:
        results = measure(args, rank, device)
        if rank == 0:
            from result_folder import write_result_folder

            results = {
                "world_size": world,
                "gpu": torch.cuda.get_device_name(device),
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "dtype": "bfloat16",
                "iters": args.iters,
                "graph_calls": args.graph_calls,
                "repeats": args.repeats,
                "env": {k: os.environ.get(k) for k in [*MULTICAST_OFF, "NCCL_ALGO"]},
                **results,
            }
            folder = write_result_folder("all-reduce-latency", results, args.out_dir)
            print(f"wrote {folder}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=None, help="default: every GPU")
    parser.add_argument("--min-bytes", type=parse_bytes, default=8 * KIB)
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 * KIB * KIB)
    parser.add_argument("--step", type=int, default=2, help="size factor between messages")
    parser.add_argument("--iters", type=int, default=50, help="eager calls per timing")
    parser.add_argument("--graph-calls", type=int, default=20, help="calls captured per graph")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    world = args.world_size or torch.cuda.device_count()
    if world < 2:
        sys.exit(f"needs at least 2 GPUs, found {torch.cuda.device_count()}")
    # Set before any process starts: the GPU hosts keep NVLink multicast off everywhere.
    os.environ.update(MULTICAST_OFF)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
