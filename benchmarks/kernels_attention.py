"""Attention kernels on the GPU: paged decode (KV-read bandwidth) and causal prefill (TFLOP/s)
beside torch SDPA and FlexAttention on the same data, with the device's copy bandwidth and bf16
matmul rate as yardsticks. Qwen2.5-7B heads (28 query, 4 KV, head dim 128), bf16.

Prefill is timed as the engine calls it, the chunk's keys read from the fused QKV rows of the
step (`ours`), and with every key read through the block table (`ours_paged_only`); the
`prefill_context` rows add earlier context read through the block table (chunked prefill, prefix
hits), beside SDPA with the equivalent boolean mask.
Every timed call runs inside a CUDA graph (as decode does in the engine), medians of several
replays after warm-up, on random non-zero data. Writes
`benchmarks/results/<UTC stamp>-kernels-attention/` (or under `--out-dir`).

    python benchmarks/kernels_attention.py [--quick] [--check | --check-only] [--sweep]
        [--out-dir DIR] [--block-size 16] [--no-flex]
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import astuple, dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

from inferengine.kernels import paged_attention as pa

DEVICE = "cuda"
HQ, HKV, D = 28, 4, 128
DTYPE = torch.bfloat16
SCALE = D**-0.5
DECODE_BATCHES = (1, 4, 16, 64, 256)
DECODE_CONTEXTS = (128, 1024, 4096, 16384, 32768)
PREFILL_CHUNKS = (256, 512, 1024, 2048, 4096, 8192)
PREFILL_TOKENS = 8192  # the batched prefill rows fill a step with this many tokens
FLEX_DECODE = {(1, 32768), (16, 4096), (64, 4096), (256, 1024)}
FLEX_PREFILL = {512, 2048, 8192}
# Chunked prefill and prefix hits: (batch, chunk, context before the chunk)
CONTEXT_PREFILL = ((1, 2048, 6144), (4, 2048, 6144), (8, 512, 3584))
GOAL_DECODE = (64, 4096, 0.70)  # batch, context, fraction of copy bandwidth
GOAL_PREFILL = (2048, 0.50)  # chunk, fraction of the matmul rate


@dataclass
class Batch:
    q: torch.Tensor
    kv_cache: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.kv_cache, self.query_start_loc, self.seq_lens, self.block_table


def build_batch(
    q_lens: list[int], seq_lens: list[int], block_size: int, dtype: torch.dtype = DTYPE,
    heads: tuple[int, int, int] | None = None,
) -> Batch:  # fmt: skip
    """Random pages under shuffled block ids (block 0 is the null block)."""
    hq, hkv, d = heads or (HQ, HKV, D)
    blocks = [math.ceil(n / block_size) for n in seq_lens]
    ids = (torch.randperm(sum(blocks), device=DEVICE) + 1).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=DEVICE)
    if len(set(blocks)) == 1:
        table.copy_(ids.view(len(seq_lens), blocks[0]))
    else:
        start = 0
        for i, n in enumerate(blocks):
            table[i, :n] = ids[start : start + n]
            start += n
    kv_cache = torch.randn(2, sum(blocks) + 1, block_size, hkv, d, dtype=dtype, device=DEVICE)
    starts = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).to(torch.int32)
    return Batch(
        q=torch.randn(sum(q_lens), hq, d, dtype=dtype, device=DEVICE),
        kv_cache=kv_cache,
        query_start_loc=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_table=table,
    )


def dense_kv(batch: Batch, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K and V gathered into [B, Hkv, seq_len, D] for SDPA and FlexAttention."""
    out = []
    for i in range(2):
        pages = batch.kv_cache[i][batch.block_table.long()]  # [B, blocks, block, Hkv, D]
        flat = pages.flatten(1, 2)[:, :seq_len]
        out.append(flat.transpose(1, 2).contiguous())
        del pages, flat
    return out[0], out[1]


def with_fused_qkv(batch: Batch) -> tuple[Batch, dict]:
    """The batch with its queries, and each query token's own key and value (read back from
    its slot), as views of one fused [T, Hq + 2 Hkv, D] buffer, as the engine's QKV projection
    lays them out; returns the batch and the `fresh_key`/`fresh_value` keywords."""
    t, hq, d = batch.q.shape
    block_size, hkv = batch.kv_cache.shape[2], batch.kv_cache.shape[3]
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    slots = []
    for i, seq_len in enumerate(lens):
        n = starts[i + 1] - starts[i]
        pos = torch.arange(seq_len - n, seq_len, device=DEVICE)
        slots.append(batch.block_table[i].long()[pos // block_size] * block_size + pos % block_size)
    slot = torch.cat(slots)
    flat = batch.kv_cache.view(2, -1, hkv, d)
    qkv = torch.empty(t, hq + 2 * hkv, d, dtype=batch.q.dtype, device=DEVICE)
    qkv[:, :hq] = batch.q
    qkv[:, hq : hq + hkv] = flat[0, slot]
    qkv[:, hq + hkv :] = flat[1, slot]
    fused = replace(batch, q=qkv[:, :hq])
    return fused, {"fresh_key": qkv[:, hq : hq + hkv], "fresh_value": qkv[:, hq + hkv :]}


def ours(batch: Batch, max_query_len: int, max_seq_len: int, **kw) -> Callable[[], object]:
    out = torch.empty_like(batch.q)
    return lambda: pa.paged_attention(
        *batch.args(), max_query_len=max_query_len, max_seq_len=max_seq_len, scale=SCALE,
        out=out, **kw,
    )  # fmt: skip


def time_ms(fn: Callable[[], object], repeats: int) -> tuple[float, str]:
    """Median milliseconds per call, from replays of a CUDA graph holding enough calls to run
    for about a millisecond (plain launches if the call cannot be captured)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    calls = max(1, min(200, int(1.0 / max(start.elapsed_time(end), 1e-3))))
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        run, mode = graph.replay, "graph"
    except Exception:  # capture is not supported by this call: time launches instead
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(calls):
                fn()

        mode = "eager"
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times), mode


def reference_rates(repeats: int) -> dict[str, float]:
    src = torch.randn(1 << 29, dtype=DTYPE, device=DEVICE)  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms, _ = time_ms(partial(dst.copy_, src), repeats)
    del src, dst
    a = torch.randn(8192, 8192, dtype=DTYPE, device=DEVICE)
    b = torch.randn(8192, 8192, dtype=DTYPE, device=DEVICE)
    mm_ms, _ = time_ms(partial(torch.matmul, a, b), repeats)
    return {
        "copy_GBps": 2 * (1 << 30) / copy_ms / 1e6,  # bytes read + written
        "matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9,
    }


def flex_call(q, k, v, causal: bool) -> Callable[[], object]:
    """Compiled FlexAttention; the causal block mask is built on the first call."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = []

    def call():
        if causal and not masks:
            n = q.shape[2]
            masks.append(create_block_mask(lambda b, h, i, j: i >= j, None, None, n, n, DEVICE))
        mask = masks[0] if causal else None
        return compiled(q, k, v, block_mask=mask, scale=SCALE, enable_gqa=True)

    return call


def attempt(row: dict, key: str, fn: Callable[[], object], repeats: int) -> float | None:
    """Time `fn` into row[key + '_ms']; a failure is recorded, not raised."""
    try:
        ms, mode = time_ms(fn, repeats)
        row[key + "_ms"], row[key + "_timing"] = ms, mode
        return ms
    except Exception as e:  # an optional comparison must not end the run
        row[key + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.synchronize()
        return None


def fits(bytes_needed: int) -> bool:
    free, _ = torch.cuda.mem_get_info()
    return bytes_needed < 0.85 * free


def bench_decode(args, rates: dict, batches, contexts) -> list[dict]:
    rows = []
    for b in batches:
        for ctx in contexts:
            kv_bytes = 2 * b * ctx * HKV * D * DTYPE.itemsize
            row = {"batch": b, "context": ctx, "kv_bytes": kv_bytes}
            rows.append(row)
            if not fits(int(2.3 * kv_bytes)):
                row["skipped"] = "over memory"
                continue
            batch = build_batch([1] * b, [ctx] * b, args.block_size)
            row["splits"] = pa.num_kv_splits(
                b, HKV, ctx, torch.cuda.get_device_properties(0).multi_processor_count
            )
            ms = attempt(row, "ours", ours(batch, 1, ctx), args.repeats)
            if ms:
                row["ours_GBps"] = kv_bytes / ms / 1e6
                row["ours_fraction_of_copy"] = row["ours_GBps"] / rates["copy_GBps"]
            k, v = dense_kv(batch, ctx)
            q4 = batch.q.view(b, 1, HQ, D).transpose(1, 2)
            expected = F.scaled_dot_product_attention(q4, k, v, scale=SCALE, enable_gqa=True)
            got = ours(batch, 1, ctx)()
            row["max_abs_diff_vs_sdpa"] = (got.float() - expected.transpose(1, 2)[:, 0].float()).abs().max().item()  # fmt: skip
            sdpa = partial(F.scaled_dot_product_attention, q4, k, v, scale=SCALE, enable_gqa=True)
            if ms := attempt(row, "sdpa", sdpa, args.repeats):
                row["sdpa_GBps"] = kv_bytes / ms / 1e6
            flex = not args.no_flex and (b, ctx) in FLEX_DECODE
            if flex and (ms := attempt(row, "flex", flex_call(q4, k, v, False), args.repeats)):
                row["flex_GBps"] = kv_bytes / ms / 1e6
            del batch, k, v, q4, expected, got
            torch.cuda.empty_cache()
            print(f"decode b={b} ctx={ctx}: {row.get('ours_ms', float('nan')):.4f} ms", flush=True)
    return rows


def bench_prefill(args, rates: dict, chunks) -> list[dict]:
    rows = []
    for chunk in chunks:
        for b in sorted({1, max(1, PREFILL_TOKENS // chunk)}):
            flops = 4 * D * HQ * b * chunk * (chunk + 1) // 2
            row = {"batch": b, "chunk": chunk, "flops": flops}
            rows.append(row)
            batch = build_batch([chunk] * b, [chunk] * b, args.block_size)
            # As the engine calls it: the chunk's keys from the fused QKV rows just written.
            fused, fresh = with_fused_qkv(batch)
            call = ours(fused, chunk, chunk, min_query_len=chunk, **fresh)
            ms = attempt(row, "ours", call, args.repeats)
            if ms:
                row["ours_TFLOPs"] = flops / ms / 1e9
                row["ours_fraction_of_matmul"] = row["ours_TFLOPs"] / rates["matmul_TFLOPs"]
            paged_only = ours(batch, chunk, chunk, min_query_len=chunk)
            if ms := attempt(row, "ours_paged_only", paged_only, args.repeats):
                row["ours_paged_only_TFLOPs"] = flops / ms / 1e9
            del fused, fresh
            k, v = dense_kv(batch, chunk)
            q4 = batch.q.view(b, chunk, HQ, D).transpose(1, 2).contiguous()
            sdpa = partial(
                F.scaled_dot_product_attention, q4, k, v, is_causal=True, scale=SCALE,
                enable_gqa=True,
            )  # fmt: skip
            if ms := attempt(row, "sdpa", sdpa, args.repeats):
                row["sdpa_TFLOPs"] = flops / ms / 1e9
            flex = not args.no_flex and chunk in FLEX_PREFILL
            if flex and (ms := attempt(row, "flex", flex_call(q4, k, v, True), args.repeats)):
                row["flex_TFLOPs"] = flops / ms / 1e9
            del batch, k, v, q4
            torch.cuda.empty_cache()
            print(
                f"prefill b={b} chunk={chunk}: {row.get('ours_ms', float('nan')):.4f} ms",
                flush=True,
            )
    return rows


def bench_prefill_context(args, rates: dict, points) -> list[dict]:
    rows = []
    for b, chunk, context in points:
        seq = context + chunk
        flops = 4 * D * HQ * b * (chunk * (chunk + 1) // 2 + chunk * context)
        row = {"batch": b, "chunk": chunk, "context": context, "flops": flops}
        rows.append(row)
        batch = build_batch([chunk] * b, [seq] * b, args.block_size)
        fused, fresh = with_fused_qkv(batch)
        call = ours(fused, chunk, seq, min_query_len=chunk, **fresh)
        if ms := attempt(row, "ours", call, args.repeats):
            row["ours_TFLOPs"] = flops / ms / 1e9
            row["ours_fraction_of_matmul"] = row["ours_TFLOPs"] / rates["matmul_TFLOPs"]
        del fused, fresh
        k, v = dense_kv(batch, seq)
        q4 = batch.q.view(b, chunk, HQ, D).transpose(1, 2).contiguous()
        visible = torch.arange(seq, device=DEVICE)[None, :] <= (
            context + torch.arange(chunk, device=DEVICE)[:, None]
        )
        sdpa = partial(
            F.scaled_dot_product_attention, q4, k, v, attn_mask=visible, scale=SCALE,
            enable_gqa=True,
        )  # fmt: skip
        if ms := attempt(row, "sdpa", sdpa, args.repeats):
            row["sdpa_TFLOPs"] = flops / ms / 1e9
        del batch, k, v, q4
        torch.cuda.empty_cache()
        print(f"prefill b={b} chunk={chunk} context={context}: "
              f"{row.get('ours_ms', float('nan')):.4f} ms", flush=True)  # fmt: skip
    return rows


def sweep(args) -> dict:
    """Times a grid of tile configs and split counts at the points the goals name, to choose
    the fixed tables in paged_attention.py."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out: dict[str, list] = {}
    decode_points = [(64, 4096), (1, 32768), (256, 1024)] if args.sweep_what != "prefill" else []
    prefill_points = [(1, 2048), (4, 2048)] if args.sweep_what != "decode" else []
    for b, ctx in decode_points:
        batch = build_batch([1] * b, [ctx] * b, args.block_size)
        rows = out.setdefault(f"decode b={b} ctx={ctx}", [])
        kv_bytes = 2 * b * ctx * HKV * D * DTYPE.itemsize
        auto = pa.num_kv_splits(b, HKV, ctx, sms)
        default = pa.DECODE_CONFIGS[D]
        grid = [(pa.TileConfig(16, bn, w, st), auto) for bn in (32, 64, 128) for w in (2, 4, 8)
                for st in (2, 3, 4)]  # fmt: skip
        grid += [(default, n) for n in sorted({1, max(1, auto // 2), 2 * auto, 4 * auto})]
        for cfg, splits in grid:
            row = {"config": astuple(cfg), "splits": splits}
            call = ours(batch, 1, ctx, decode_config=cfg, num_splits=splits)
            if ms := attempt(row, "ours", call, args.repeats):
                row["GBps"] = kv_bytes / ms / 1e6
            rows.append(row)
        del batch
    for b, chunk in prefill_points:
        # As the engine calls it: the chunk's own keys from the fused QKV rows.
        batch, fresh = with_fused_qkv(build_batch([chunk] * b, [chunk] * b, args.block_size))
        rows = out.setdefault(f"prefill b={b} chunk={chunk}", [])
        flops = 4 * D * HQ * b * chunk * (chunk + 1) // 2
        # One query head per tile (FlashAttention's layout), and the whole GQA group per tile.
        grid = [pa.TileConfig(bm, bn, w, st, 1) for bm in (64, 128) for bn in (64, 128)
                for w in (4, 8) for st in (2, 3, 4)]  # fmt: skip
        grid += [pa.TileConfig(bm, bn, w, st) for bm, bn, w, st in
                 ((128, 32, 4, 2), (128, 32, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 2))]  # fmt: skip
        for cfg in grid:
            row = {"config": astuple(cfg)}
            if ms := attempt(
                row, "ours",
                ours(batch, chunk, chunk, min_query_len=chunk, prefill_config=cfg, **fresh),
                args.repeats,
            ):  # fmt: skip
                row["TFLOPs"] = flops / ms / 1e9
            rows.append(row)
        del batch, fresh
    for name, rows in out.items():
        key = "GBps" if name.startswith("decode") else "TFLOPs"
        best = sorted((r for r in rows if key in r), key=lambda r: -r[key])[:5]
        print(f"sweep {name}: " + "; ".join(f"{r['config']} s={r.get('splits', '-')} {r[key]:.0f}" for r in best))  # fmt: skip
    return out


def environment_lines() -> list[str]:
    import triton

    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        driver = f"unknown ({e})"
    return [
        f"torch_device: {props.name}, {props.multi_processor_count} SMs, "
        f"{props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}",
        f"driver: {driver}",
        f"triton: {triton.__version__}",
    ]


def print_tables(results: dict) -> None:
    rates = results["reference"]
    print(f"\ncopy {rates['copy_GBps']:.0f} GB/s, bf16 matmul {rates['matmul_TFLOPs']:.0f} TFLOP/s")
    print(f"{'decode':>14} {'ours us':>9} {'GB/s':>7} {'%copy':>6} {'sdpa GB/s':>10} {'flex GB/s':>10} {'splits':>6}")  # fmt: skip
    for r in results.get("decode", []):
        label = f"b{r['batch']} ctx{r['context']}"
        if "skipped" in r:
            print(f"{label:>14} skipped: {r['skipped']}")
            continue
        print(f"{label:>14} {r.get('ours_ms', math.nan) * 1e3:9.1f} {r.get('ours_GBps', math.nan):7.0f} "
              f"{100 * r.get('ours_fraction_of_copy', math.nan):5.1f}% {r.get('sdpa_GBps', math.nan):10.0f} "
              f"{r.get('flex_GBps', math.nan):10.0f} {r.get('splits', 0):6d}")  # fmt: skip
    print(
        f"{'prefill':>14} {'ours us':>9} {'TFLOP/s':>8} {'%mm':>6} {'sdpa TF/s':>10} {'flex TF/s':>10}"
    )
    for r in results.get("prefill", []):
        label = f"b{r['batch']} c{r['chunk']}"
        print(f"{label:>14} {r.get('ours_ms', math.nan) * 1e3:9.1f} {r.get('ours_TFLOPs', math.nan):8.0f} "
              f"{100 * r.get('ours_fraction_of_matmul', math.nan):5.1f}% {r.get('sdpa_TFLOPs', math.nan):10.0f} "
              f"{r.get('flex_TFLOPs', math.nan):10.0f}")  # fmt: skip
    for r in results.get("prefill_context", []):
        label = f"b{r['batch']} c{r['chunk']}+{r['context']}"
        print(f"{label:>14} {r.get('ours_ms', math.nan) * 1e3:9.1f} {r.get('ours_TFLOPs', math.nan):8.0f} "
              f"{100 * r.get('ours_fraction_of_matmul', math.nan):5.1f}% {r.get('sdpa_TFLOPs', math.nan):10.0f}")  # fmt: skip
    for goal in results.get("goals", []):
        print(f"goal {goal['name']}: {'met' if goal['met'] else 'NOT met'} ({goal['value']:.2f})")


def goals(results: dict) -> list[dict]:
    out = []
    b, ctx, want = GOAL_DECODE
    for r in results.get("decode", []):
        if (r["batch"], r["context"]) == (b, ctx) and "ours_fraction_of_copy" in r:
            value = r["ours_fraction_of_copy"]
            out.append({"name": f"decode b{b} ctx{ctx} >= {want:.0%} of copy bandwidth",
                        "value": value, "met": value >= want})  # fmt: skip
    chunk, want = GOAL_PREFILL
    for r in results.get("prefill", []):
        if r["chunk"] == chunk and "ours_fraction_of_matmul" in r:
            value = r["ours_fraction_of_matmul"]
            out.append({"name": f"prefill b{r['batch']} chunk{chunk} >= {want:.0%} of matmul",
                        "value": value, "met": value >= want})  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few points, fewer repeats")
    parser.add_argument("--check", action="store_true", help="correctness at real sizes first")
    parser.add_argument("--check-only", action="store_true", help="correctness, no timing")
    parser.add_argument("--check-dtypes", default="bfloat16,float16,float32")
    parser.add_argument("--check-block-sizes", default="16,32")
    parser.add_argument("--sweep", action="store_true", help="time tile configs instead")
    parser.add_argument("--sweep-what", choices=["decode", "prefill", "all"], default="all")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out-dir", help="parent folder of the result folder (e.g. $OUT)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    args.repeats = args.repeats or (5 if args.quick else 15)
    torch.manual_seed(0)
    started = time.time()
    results: dict = {
        "decode_configs": {k: astuple(v) for k, v in pa.DECODE_CONFIGS.items()},
        "prefill_configs": {k: astuple(v) for k, v in pa.PREFILL_CONFIGS.items()},
        "block_size": args.block_size,
        "heads": [HQ, HKV, D],
        "dtype": str(DTYPE),
    }
    failed = False
    if args.check or args.check_only:
        dtypes = [getattr(torch, name) for name in args.check_dtypes.split(",")]
        block_sizes = [int(n) for n in args.check_block_sizes.split(",")]
        from attention_checks import run_checks

        results["check"] = run_checks(block_sizes, dtypes)
        failed = not all(c["ok"] for c in results["check"])
    if not failed and not args.check_only:
        try:
            results["reference"] = reference_rates(args.repeats)
            if args.sweep:
                results["sweep"] = sweep(args)
            else:
                quick = args.quick
                results["decode"] = bench_decode(
                    args, results["reference"], (1, 64) if quick else DECODE_BATCHES,
                    (4096, 32768) if quick else DECODE_CONTEXTS,
                )  # fmt: skip
                results["prefill"] = bench_prefill(
                    args, results["reference"], (512, 2048) if quick else PREFILL_CHUNKS
                )
                results["prefill_context"] = bench_prefill_context(
                    args, results["reference"], CONTEXT_PREFILL
                )
                results["goals"] = goals(results)
        except Exception:
            results["error"] = traceback.format_exc()
            print(results["error"], file=sys.stderr)
            failed = True
    results["wall_s"] = time.time() - started
    folder = write_result_folder("kernels-attention", results, root=args.out_dir)
    with open(folder / "environment.txt", "a") as f:
        f.write("\n".join(environment_lines()) + "\n")
    if "reference" in results:
        print_tables(results)
    print(f"\nwrote {folder}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
