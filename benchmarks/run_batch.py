"""run-batch against `LLM.generate`: output tokens/s on the same prompts, same engine, same settings.

Both run on one warm engine, alternating, `--repeats` times each; the ratio is of medians (the
ratio of best runs is reported too, as a check on a noisy machine). Every prompt
asks for exactly `--max-tokens` tokens (greedy, EOS ignored), so both produce the same tokens.
run-batch's time includes reading the input file and writing the output file. The issue's target:
run-batch >= 0.97 x LLM.generate. Writes `benchmarks/results/<UTC stamp>-run-batch/`.

    python benchmarks/run_batch.py [--num-prompts 64] [--max-tokens 64] [--format openai]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_cpu import QUESTIONS
from result_folder import write_result_folder

TARGET_RATIO = 0.97


def build_prompts(n: int) -> list[str]:
    return [f"Question {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:" for i in range(n)]


def write_input(path: Path, fmt: str, prompts: list[str], max_tokens: int) -> None:
    settings = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    rows = []
    for i, prompt in enumerate(prompts):
        row = {"prompt": prompt, **settings}
        if fmt == "openai":
            row = {"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions", "body": row}
        rows.append(row)
    if fmt in ("openai", "jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)


def time_generate(llm, prompts: list[str], max_tokens: int) -> tuple[float, int]:
    from inferengine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def time_run_batch(llm, inp: Path, out: Path, progress: bool) -> tuple[float, int]:
    from inferengine.entrypoints.batch import BatchConfig, run_batch

    out.unlink(missing_ok=True)
    start = time.perf_counter()
    summary = run_batch(llm.llm_engine, BatchConfig(str(inp), str(out), quiet=not progress))
    elapsed = time.perf_counter() - start
    assert summary.failed == 0, summary.describe()
    return elapsed, summary.output_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--format", choices=("openai", "jsonl", "parquet"), default="openai")
    parser.add_argument("--progress", action="store_true", help="run-batch with its progress bar")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    from inferengine import LLM

    llm = LLM(args.model)
    prompts = build_prompts(args.num_prompts)
    suffix = ".parquet" if args.format == "parquet" else ".jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / f"in{suffix}", Path(tmp) / f"out{suffix}"
        write_input(inp, args.format, prompts, args.max_tokens)
        time_generate(llm, prompts[:4], 4)  # warm-up
        time_run_batch(llm, inp, out, progress=False)
        runs: dict[str, list[tuple[float, int]]] = {"llm_generate": [], "run_batch": []}
        for _ in range(args.repeats):
            runs["llm_generate"].append(time_generate(llm, prompts, args.max_tokens))
            runs["run_batch"].append(time_run_batch(llm, inp, out, args.progress))
    results: dict = {
        "workload": {
            "model": args.model,
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "format": args.format,
            "repeats": args.repeats,
            "device": llm.llm_engine.config.device,
            "threads": torch.get_num_threads(),
        }
    }
    for name, samples in runs.items():
        seconds = [s for s, _ in samples]
        tokens = samples[0][1]
        results[name] = {
            "seconds": seconds,
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / statistics.median(seconds),
            "best_output_tokens_per_s": tokens / min(seconds),
        }
    batch, generate = results["run_batch"], results["llm_generate"]
    ratio = batch["output_tokens_per_s"] / generate["output_tokens_per_s"]
    results["ratio_run_batch_vs_generate"] = ratio
    results["ratio_of_best_runs"] = (
        batch["best_output_tokens_per_s"] / generate["best_output_tokens_per_s"]
    )
    results["target_ratio"] = TARGET_RATIO
    results["meets_target"] = ratio >= TARGET_RATIO
    folder = write_result_folder("run-batch", results, args.out_dir)
    print(f"{'system':<16}{'output tok/s':>14}{'best tok/s':>12}{'median s':>10}")
    for name in runs:
        r = results[name]
        median = statistics.median(r["seconds"])
        tok_s, best = r["output_tokens_per_s"], r["best_output_tokens_per_s"]
        print(f"{name:<16}{tok_s:>14.1f}{best:>12.1f}{median:>10.2f}")
    best_ratio = results["ratio_of_best_runs"]
    print(f"ratio {ratio:.3f} (of best runs {best_ratio:.3f}; target >= {TARGET_RATIO})")
    print(f"results: {folder}")


if __name__ == "__main__":
    main()
