"""Skinny GEMM (decode-sized linears) against cuBLAS on the GPU: µs and weight-read TB/s, and a
sweep of tile configs that prints entries for `skinny_gemm.CONFIGS`.

y = x @ Wᵀ (+ bias) with x [M, K] bf16, M <= 32, at the linears of Qwen2.5-7B and Llama-3-8B.
Every timed call runs inside a CUDA graph that cycles through enough copies of W to overflow
the L2 cache (a decode step reads each weight once, cold), medians of several replays after
warm-up. The default run checks each result against the float32 reference before timing it.
Writes `benchmarks/results/<UTC stamp>-skinny-gemm/` (or under `--out-dir`).

With --fp8, W is FP8 with a scale per row (the W8A16 kernel), the baseline is the W8A8 path
(`fp8_gemm.scaled_mm_linear`: per-token quantization + `torch._scaled_mm`), a sweep prints
entries for `skinny_gemm.FP8_CONFIGS`, and the plain run prints `fp8_gemm.W8A16_MAX_M`
entries: the largest M at which W8A16 wins, per shape.

    python benchmarks/skinny_gemm.py [--sweep] [--fp8] [--shapes qwen-o,llama] [--m 1,16]
        [--budget-s 210] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import math
import multiprocessing
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

from inferengine.kernels import fp8_gemm as fg
from inferengine.kernels import skinny_gemm as sg

DEVICE = "cuda"
DTYPE = torch.bfloat16
SHAPES = sg.DECODE_LINEAR_SHAPES
M_VALUES = (1, 2, 4, 8, 16, 24, 32)
SWEEP_M = (1, 4, 16, 32)  # buckets 2, 8 and 24 take the next larger bucket's entry
COLD_BYTES = 200 << 20  # weight copies cycled per graph: 4x the H100's 50 MB L2
GOAL_TBPS = 2.9
# Tensor-core tiles (block_n, block_k, num_warps, num_stages), tried with pointer and TMA loads.
MMA_TILES = [(16, 256, 4, 4), (32, 256, 4, 4), (64, 128, 4, 4), (64, 128, 4, 6),
             (64, 256, 4, 3), (128, 128, 4, 3), (128, 128, 8, 4)]  # fmt: skip
FMA_TILES = [(8, 512, 4), (16, 256, 4), (4, 1024, 4)]  # at M <= 4, rows shrink by M's pad
# FP8 rows are half the bytes: longer K blocks and more warps per tile as well (the first FP8
# sweep found qkv and o at one row under 2 TB/s with the tiles above).
FP8_FMA_TILES = [(8, 1024, 4), (16, 512, 4), (4, 2048, 4), (8, 512, 8), (16, 1024, 8)]
# FP8 tiles loading W 8 bytes at a time (vec_k=8), x alike: BLOCK_K = 8 x 32 lanes x warps keeps
# each warp on its own K range, so a thread's x serves all its rows with no reshuffle.
FP8_VEC8_TILES = [(2, 1024, 4), (4, 1024, 4), (8, 1024, 4), (16, 1024, 4), (4, 512, 2),
                  (8, 512, 2), (16, 512, 2), (2, 2048, 8), (4, 2048, 8), (8, 2048, 8)]  # fmt: skip
METHODS = ("dot", "tma", "fma")


@dataclass
class Problem:
    name: str
    n: int
    k: int
    weights: list[torch.Tensor]  # copies of one random W, cycled to defeat the L2 cache
    bias: torch.Tensor | None
    scale: torch.Tensor | None = None  # FP8 W's per-row scales

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * self.weights[0].element_size()


def make_problem(name: str, fp8: bool = False) -> Problem:
    n, k, has_bias = SHAPES[name]
    w_bytes = 1 if fp8 else DTYPE.itemsize
    copies = max(1, min(8, math.ceil(COLD_BYTES / (n * k * w_bytes))))
    w = torch.randn(n, k, device=DEVICE, dtype=DTYPE) / k**0.5
    scale = None
    if fp8:
        w, scale = fg.quantize_rows(w)
    weights = [w] + [w.clone() for _ in range(copies - 1)]
    bias = torch.randn(n, device=DEVICE, dtype=DTYPE) if has_bias else None
    return Problem(name, n, k, weights, bias, scale)


def time_us(make_call: Callable[[torch.Tensor], Callable[[], object]],
            weights: list[torch.Tensor], repeats: int, est_us: float) -> float:  # fmt: skip
    """Median µs per call from replays of a CUDA graph of ~2 ms of calls cycling through the
    weight copies (`est_us` per call sizes the graph)."""
    calls = [make_call(w) for w in weights]
    rounds = max(1, min(1000 // len(calls), math.ceil(2000 / (est_us * len(calls)))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls * 2:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (rounds * len(calls)))
    del graph
    return statistics.median(times)


def ours(problem: Problem, x: torch.Tensor, cfg: sg.SkinnyConfig | None):
    out = torch.empty(x.shape[0], problem.n, device=DEVICE, dtype=DTYPE)
    b, s = problem.bias, problem.scale
    return lambda w: lambda: sg.skinny_linear(x, w, b, out=out, config=cfg, weight_scale=s)


def cublas(problem: Problem, x: torch.Tensor):
    """cuBLAS: F.linear, or for FP8 W the W8A8 path (per-token quantization + _scaled_mm)."""
    if problem.scale is not None:
        return lambda w: lambda: fg.scaled_mm_linear(x, w, problem.scale, problem.bias)
    return lambda w: lambda: F.linear(x, w, problem.bias)


def attempt(row: dict, key: str, make_call, problem: Problem, repeats: int) -> float | None:
    """Time into row[key + '_us'] and row[key + '_TBps']; a failure is recorded, not raised."""
    try:
        est_us = 2 + problem.weight_bytes / 3e6  # at 3 TB/s
        us = time_us(make_call, problem.weights, repeats, est_us)
    except Exception as e:  # one bad config must not end the run
        row[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.synchronize()
        return None
    row[key + "_us"], row[key + "_TBps"] = us, problem.weight_bytes / us / 1e6
    return us


def check(problem: Problem, x: torch.Tensor, cfg: sg.SkinnyConfig | None) -> dict:
    """Against the float32 reference (bf16 tolerance), poisoned output, two identical runs."""
    w, b, s = problem.weights[0], problem.bias, problem.scale
    w32 = w.float() if s is None else fg.dequantize_rows(w, s)
    want = F.linear(x.float(), w32, None if b is None else b.float())
    out = torch.full((x.shape[0], problem.n), float("nan"), device=DEVICE, dtype=DTYPE)
    got = sg.skinny_linear(x, w, b, out=out, config=cfg, weight_scale=s).float()
    excess = ((got - want).abs() - 8e-3 * want.abs()).max().item()
    again = sg.skinny_linear(x, w, b, config=cfg, weight_scale=s).float()
    ok = excess <= 1e-3 and not got.isnan().any().item() and torch.equal(got, again)
    return {"check_ok": bool(ok), "check_excess_error": excess}


def _compile_points(points: list[tuple[str, int, sg.SkinnyConfig, bool]]) -> int:
    """Worker: run each config once on scratch data so Triton compiles it into its disk cache."""
    failures = 0
    for name, m, cfg, fp8 in points:
        n, k, has_bias = SHAPES[name]
        try:
            w = torch.zeros(n, k, device=DEVICE, dtype=fg.FP8_DTYPE if fp8 else DTYPE)
            s = torch.ones(n, device=DEVICE) if fp8 else None
            x = torch.randn(m, k, device=DEVICE, dtype=DTYPE)
            b = torch.zeros(n, device=DEVICE, dtype=DTYPE) if has_bias else None
            sg.skinny_linear(x, w, b, config=cfg, weight_scale=s)
            torch.cuda.synchronize()
        except Exception:  # reported again when the main process times it
            failures += 1
    return failures


def compile_key(name: str, m: int, cfg: sg.SkinnyConfig, fp8: bool) -> tuple:
    """What Triton specializes a launch on here (constexprs, M == 1, M % 16, reduce mode)."""
    _, k, has_bias = SHAPES[name]
    split = sg.num_splits(k, cfg.block_k, cfg.split_k)[0] > 1
    reduce = cfg.reduce if split else "none"
    shape = (sg.m_pad(m, cfg.method), m == 1, m % 16 == 0, has_bias, k % cfg.block_k == 0, fp8)
    return (*astuple(replace(cfg, split_k=1, reduce=reduce)), *shape)


def precompile(points: list[tuple[str, int, sg.SkinnyConfig, bool]]) -> None:
    """Compile each distinct launch once, in parallel worker processes (Triton's disk cache is
    shared), so that the timing loop only loads kernels."""
    started = time.time()
    unique = list({compile_key(*p): p for p in points}.values())
    workers = max(1, min(len(unique), (os.cpu_count() or 2) - 1, 15))
    chunks = [unique[i::workers] for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    try:
        with cf.ProcessPoolExecutor(workers, mp_context=context) as pool:
            failures = sum(pool.map(_compile_points, chunks))
    except Exception as e:  # the timing loop compiles what is missing, only slower
        print(f"precompiling failed ({type(e).__name__}: {e}); going on", flush=True)
        return
    print(f"compiled {len(unique)} kernels in {time.time() - started:.0f} s with {workers} "
          f"processes ({failures} failed)", flush=True)  # fmt: skip


def tile_candidates(
    m: int, n: int, k: int, sms: int, fp8: bool = False, methods: tuple[str, ...] = METHODS
) -> list[sg.SkinnyConfig]:
    """Stage one: each tile of `methods` with the split that fills one wave of programs (FMA
    tiles read their first W tile ahead of the PDL wait, as the table's do: without it every
    one-row shape was slower, and so was the decode step, 20261127T133403Z-decode-step-variants)."""
    out = []
    for method in ("dot", "tma"):
        if method in methods:
            out += [sg.SkinnyConfig(bn, bk, 1, w, st, method) for bn, bk, w, st in MMA_TILES]
    if m <= 4 and "fma" in methods:
        pad = sg.m_pad(m, "fma")
        tiles = FMA_TILES + (FP8_FMA_TILES if fp8 else [])
        out += [sg.SkinnyConfig(max(1, bn // pad), bk, 1, w, 1, "fma") for bn, bk, w in tiles]
        if fp8:
            out += [sg.SkinnyConfig(max(1, bn // pad), bk, 1, w, 1, "fma", vec_k=8)
                    for bn, bk, w in FP8_VEC8_TILES]  # fmt: skip
    w_bytes = 1 if fp8 else 2
    return [replace(c, split_k=sg.wave_split(c, m, n, k, sms, w_bytes)) for c in out]


def split_candidates(best: sg.SkinnyConfig, n: int, k: int, sms: int) -> list[sg.SkinnyConfig]:
    """Stage two: the best tile at other splits, up to ~8 programs per SM and >= 2 K steps."""
    tiles, k_tiles = -(-n // best.block_n), -(-k // best.block_k)
    seen = {sg.num_splits(k, best.block_k, best.split_k)[0]}
    out = []
    for s in (*range(1, 9), 10, 12, 14, 16, 20, 24, 28, 32):
        splits = sg.num_splits(k, best.block_k, s)[0]
        if splits not in seen and (s == 1 or (s <= k_tiles // 2 and tiles * s <= 8 * sms)):
            seen.add(splits)
            out.append(replace(best, split_k=s))
    return out


def sweep_point(
    problem: Problem, x: torch.Tensor, sms: int, repeats: int, methods: tuple[str, ...] = METHODS
) -> dict:
    """Tiles at their heuristic split, then the best tile at other splits; the three fastest
    are timed again at triple repeats before one is picked; then what the other split-K
    reductions would cost."""
    rows: list[dict] = []

    def run(cfg: sg.SkinnyConfig, times: int = repeats) -> None:
        rows.append({"config": asdict(cfg)})
        attempt(rows[-1], "ours", ours(problem, x, cfg), problem, times)

    def fastest() -> dict | None:
        timed = [r for r in rows if "ours_us" in r and r["config"]["reduce"] == "serial"]
        return min(timed, key=lambda r: r["ours_us"], default=None)

    fp8 = problem.scale is not None
    for cfg in tile_candidates(x.shape[0], problem.n, problem.k, sms, fp8, methods):
        run(cfg)
    if (best := fastest()) is None:
        return {"candidates": rows}
    best_cfg = sg.SkinnyConfig(**best["config"])
    for cfg in split_candidates(best_cfg, problem.n, problem.k, sms):
        run(cfg)
    timed = sorted((r for r in rows if "ours_us" in r), key=lambda r: r["ours_us"])
    for row in timed[:3]:
        cfg = sg.SkinnyConfig(**row["config"])
        attempt(row, "ours", ours(problem, x, cfg), problem, 3 * repeats)
    best = fastest()
    cfg = sg.SkinnyConfig(**best["config"])
    if sg.num_splits(problem.k, cfg.block_k, cfg.split_k)[0] > 1:
        for mode in ("kernel", "atomic"):
            run(replace(cfg, reduce=mode))
    return {"best": best, "candidates": rows}


def sweep(args, names: list[str], ms: list[int], sms: int, started: float) -> dict:
    plan = [(name, m, cfg, args.fp8) for name in names for m in ms
            for cfg in tile_candidates(m, *SHAPES[name][:2], sms, args.fp8, args.methods)
            ]  # fmt: skip
    plan += [(name, m, replace(cfg, split_k=s), fp8) for name, m, cfg, fp8 in plan
             for s in (1, 2)]  # fmt: skip
    precompile(plan)
    results: dict = {}
    for name in names:
        if time.time() - started > args.budget_s:
            print(f"time budget spent: skipping {name}", flush=True)
            continue
        problem = make_problem(name, args.fp8)
        for m in ms:
            x = torch.randn(m, problem.k, device=DEVICE, dtype=DTYPE)
            point = {"name": name, "m": m}
            attempt(point, "cublas", cublas(problem, x), problem, args.repeats)
            point.update(sweep_point(problem, x, sms, args.repeats, args.methods))
            results[f"{name} m={m}"] = point
            if "best" in point:
                best = point["best"]
                print(f"sweep {name:>14} m={m:<2} best {best['ours_us']:8.1f} us "
                      f"{best['ours_TBps']:5.2f} TB/s (cuBLAS {point.get('cublas_TBps', math.nan):5.2f})"
                      f"  {tuple(best['config'].values())}", flush=True)  # fmt: skip
        del problem
        torch.cuda.empty_cache()
    return results


def table_entries(results: dict, fp8: bool = False) -> str:
    """Lines to paste into skinny_gemm.CONFIGS (FP8_CONFIGS with --fp8)."""
    table = "FP8_CONFIGS" if fp8 else "CONFIGS"
    lines = [f"{table}: dict[tuple[int, int, int], SkinnyConfig] = {{"]
    for point in results.values():
        if "best" not in point:
            continue
        n, k, _ = SHAPES[point["name"]]
        c = point["best"]["config"]
        extra = "" if c.get("w_ahead", True) else ", w_ahead=False"
        extra += f", vec_k={c['vec_k']}" if c.get("vec_k") else ""
        lines.append(
            f"    ({n}, {k}, {point['m']}): SkinnyConfig({c['block_n']}, {c['block_k']}, "
            f'{c["split_k"]}, {c["num_warps"]}, {c["num_stages"]}, "{c["method"]}"{extra}),'
            f"  # {point['name']} {point['best']['ours_TBps']:.2f} TB/s"
        )
    return "\n".join([*lines, "}"])


def bench(args, names: list[str], ms: list[int]) -> list[dict]:
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    w_bytes = 1 if args.fp8 else 2
    for name in names:
        problem = make_problem(name, args.fp8)
        for m in ms:
            x = torch.randn(m, problem.k, device=DEVICE, dtype=DTYPE)
            cfg = sg.choose_config(m, problem.n, problem.k, sms, args.fp8)
            tabled = cfg != sg.default_config(m, problem.n, problem.k, sms, w_bytes)
            row = {"name": name, "m": m, "n": problem.n, "k": problem.k, "config": asdict(cfg),
                   "from_table": tabled}  # fmt: skip
            row.update(check(problem, x, None))
            attempt(row, "ours", ours(problem, x, None), problem, args.repeats)
            attempt(row, "cublas", cublas(problem, x), problem, args.repeats)
            rows.append(row)
            print(f"{name:>14} m={m:<2} ours {row.get('ours_us', math.nan):8.1f} us "
                  f"{row.get('ours_TBps', math.nan):5.2f} TB/s | cuBLAS {row.get('cublas_us', math.nan):8.1f} us "
                  f"{row.get('cublas_TBps', math.nan):5.2f} TB/s | check {'ok' if row['check_ok'] else 'FAIL'}",
                  flush=True)  # fmt: skip
        del problem
        torch.cuda.empty_cache()
    return rows


def crossover_entries(rows: list[dict]) -> str:
    """Lines to paste into fp8_gemm.W8A16_MAX_M: per shape, the largest M measured at which
    W8A16 beat the W8A8 path (0: it never did)."""
    best: dict[tuple[int, int], int] = {}
    for row in rows:
        key = (row["n"], row["k"])
        best.setdefault(key, 0)
        if row.get("ours_us", math.inf) < row.get("cublas_us", 0):
            best[key] = max(best[key], row["m"])
    lines = ["W8A16_MAX_M: dict[tuple[int, int], int] = {"]
    lines += [f"    ({n}, {k}): {m}," for (n, k), m in best.items()]
    return "\n".join([*lines, "}"])


def copy_tbps(repeats: int) -> float:
    """Device copy bandwidth, bytes read + written, as a yardstick."""
    src = torch.ones(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    us = time_us(lambda s: lambda: dst.copy_(s), [src], repeats, est_us=700)
    return 2 * (1 << 30) / us / 1e6


def select(spec: str | None, names: list[str]) -> list[str]:
    """Comma-separated names or prefixes ('qwen', 'llama-down')."""
    if not spec:
        return names
    wanted = [s.strip() for s in spec.split(",") if s.strip()]
    return [n for n in names if any(n == w or n.startswith(w) for w in wanted)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time a grid of tile configs")
    parser.add_argument("--fp8", action="store_true", help="FP8 W (W8A16) against W8A8")
    parser.add_argument("--shapes", help="comma-separated shape names or prefixes")
    parser.add_argument("--m", help="comma-separated M values")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="sweep: comma-separated methods to try"
    )
    parser.add_argument(
        "--budget-s", type=float, default=210.0, help="sweep: stop new shapes after"
    )
    parser.add_argument("--out-dir", help="parent folder of the result folder (e.g. $OUT)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    names = select(args.shapes, list(SHAPES))
    args.methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    default_ms = SWEEP_M if args.sweep else M_VALUES
    ms = [int(v) for v in args.m.split(",")] if args.m else list(default_ms)
    torch.manual_seed(0)
    started = time.time()
    import triton

    props = torch.cuda.get_device_properties(0)
    results: dict = {"device": f"{props.name}, {props.multi_processor_count} SMs",
                     "triton": triton.__version__, "torch": torch.__version__, "shapes": {n: SHAPES[n] for n in names},
                     "m": ms, "fp8": args.fp8,
                     "table": {str(k): asdict(v) for k, v in
                               (sg.FP8_CONFIGS if args.fp8 else sg.CONFIGS).items()}}  # fmt: skip
    failed = False
    try:
        results["copy_TBps"] = copy_tbps(args.repeats)
        print(f"device copy {results['copy_TBps']:.2f} TB/s (read + write)", flush=True)
        if args.sweep:
            results["sweep"] = sweep(args, names, ms, props.multi_processor_count, started)
            results["table_entries"] = table_entries(results["sweep"], args.fp8)
            print("\n" + results["table_entries"])
        else:
            results["rows"] = bench(args, names, ms)
            failed = not all(r["check_ok"] for r in results["rows"])
            if args.fp8:
                results["crossover_entries"] = crossover_entries(results["rows"])
                print("\n" + results["crossover_entries"])
            met = [r for r in results["rows"] if r.get("ours_TBps", 0) >= GOAL_TBPS]
            beat = [
                r for r in results["rows"] if r.get("ours_us", math.inf) < r.get("cublas_us", 0)
            ]
            print(
                f"\n>= {GOAL_TBPS} TB/s at {len(met)}/{len(results['rows'])} points; "
                f"faster than cuBLAS at {len(beat)}; checks {'FAILED' if failed else 'ok'}"
            )
    except Exception:
        results["error"] = traceback.format_exc()
        print(results["error"], file=sys.stderr)
        failed = True
    results["wall_s"] = time.time() - started
    folder = write_result_folder("skinny-gemm", results, root=args.out_dir)
    print(f"wrote {folder} ({results['wall_s']:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
