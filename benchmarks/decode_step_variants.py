"""Batch-1 decode step under variants of the skinny-GEMM config tables, A/B on one GPU.

Each variant runs in a process of its own: a dummy-weight model (Qwen2.5-7B shape by default),
one request decoding from a 256-token prompt, CUDA graphs and PDL on, then five timings of 100
pipelined steps (as served: the per-token time); the median is reported. Variants alternate
round by round, so drift hits them alike. A variant names the table (bf16 `CONFIGS` or
`FP8_CONFIGS`) and changes to apply to its FMA entries before the engine starts:

    python benchmarks/decode_step_variants.py [--rounds 2] [--out-dir DIR]

The built-in variants are this change's A/B: the tables as committed ("table") against every
FMA entry reading its first W tile after the PDL wait, with FP8's one-row gate/up entry as
before ("before").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

# The one-row FP8 gate/up entry before vec_k=8 (20261125T025200Z-skinny-gemm's pick).
BEFORE_FP8_GATE_UP = {"key": [37888, 3584, 1], "config": [16, 256, 1, 4, 1, "fma"]}


def variants() -> list[dict]:
    out = []
    for quant in (None, "fp8"):
        out.append({"name": f"{quant or 'bf16'} table", "quant": quant})
        before = {"name": f"{quant or 'bf16'} before", "quant": quant, "w_ahead": False}
        if quant:
            before["set"] = [BEFORE_FP8_GATE_UP]
        out.append(before)
    return out


def run_variant(spec: dict, model: str) -> dict:
    import torch

    from inferengine.kernels import skinny_gemm as sg

    table = sg.FP8_CONFIGS if spec["quant"] else sg.CONFIGS
    if "w_ahead" in spec:
        for key, cfg in list(table.items()):
            if cfg.method == "fma":
                table[key] = replace(cfg, w_ahead=spec["w_ahead"])
    for entry in spec.get("set", []):
        cfg = sg.SkinnyConfig(*entry["config"], w_ahead=spec.get("w_ahead", True))
        table[tuple(entry["key"])] = cfg
    from inferengine import LLM, SamplingParams

    llm = LLM(
        model, load_format="dummy", max_model_len=4096, max_num_seqs=16,
        gpu_memory_utilization=0.85, quantization=spec["quant"],
        kv_cache_dtype="fp8" if spec["quant"] else "auto",
    )  # fmt: skip
    engine = llm.llm_engine
    core = engine.core
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    prompt = torch.randint(0, 30000, (256,), generator=torch.Generator().manual_seed(0))
    engine.add_request("p0", {"prompt_token_ids": prompt.tolist()}, params)
    while core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running
    ):
        core.step()
    for _ in range(20):
        core.step()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(100):
            core.step()
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - start) * 10)  # ms per step
    one_row = {str(k): asdict(v) for k, v in table.items() if k[2] == 1}
    return {**spec, "step_ms": statistics.median(runs), "runs_ms": runs, "m1_table": one_row}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="configs/qwen2.5-7b")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out-dir", help="parent folder of the result folder (e.g. $OUT)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_variant(json.loads(args.child), args.model)), flush=True)
        return 0
    import torch

    results: dict = {"gpu": torch.cuda.get_device_name(), "model": args.model, "runs": []}
    specs = variants()
    for rnd in range(args.rounds):
        order = specs if rnd % 2 == 0 else specs[::-1]
        for spec in order:
            cmd = [sys.executable, __file__, "--model", args.model, "--child", json.dumps(spec)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if not found:
                print(f"{spec['name']} failed:\n{proc.stderr[-2000:]}", flush=True)
                results["runs"].append({**spec, "round": rnd, "error": proc.stderr[-2000:]})
                continue
            row = {**json.loads(found[0][len("RESULT ") :]), "round": rnd}
            results["runs"].append(row)
            print(f"round {rnd} {spec['name']:<12} {row['step_ms']:.3f} ms", flush=True)
    summary = {}
    for spec in specs:
        runs = results["runs"]
        times = [r["step_ms"] for r in runs if r["name"] == spec["name"] and "step_ms" in r]
        if times:
            summary[spec["name"]] = {"median_ms": statistics.median(times), "runs_ms": times}
    for name in ("table", "before"):
        if f"fp8 {name}" in summary and f"bf16 {name}" in summary:
            ratio = summary[f"fp8 {name}"]["median_ms"] / summary[f"bf16 {name}"]["median_ms"]
            summary[f"fp8/bf16 {name}"] = ratio
    results["summary"] = summary
    for key, value in summary.items():
        print(f"{key}: {value if isinstance(value, float) else value['median_ms']:.3f}")
    folder = write_result_folder("decode-step-variants", results, root=args.out_dir)
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
