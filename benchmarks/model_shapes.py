"""Real-shape smoke on a GPU: for one config per model family (dummy weights), start our server,
serve a W1 load and a batch-1 load with `inferengine bench serve`, and record start-up time,
throughput and the decode step time (median ITL / TPOT as the client sees them).

    python benchmarks/model_shapes.py [--models llama-3.2-1b qwen3-8b ...] [--out-dir DIR]

Each model runs in a folder of its own under /tmp holding its `configs/<name>/config.json` and
the shared SmolLM2 tokenizer; where the model's vocabulary is smaller than the tokenizer's
(Mistral's 32,000), the tokenizer is cut to the model's vocabulary so no prompt holds an id the
embedding lacks. The result folder keeps one summary JSON, the command, the environment and
the tail of each server log, not per-request arrays.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from result_folder import write_result_folder

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# name -> max model len (Mistral's 4k window only applies past 4k tokens).
MODELS = {
    "smollm2-135m": 2048,
    "llama-3.2-1b": 2048,
    "llama-3.1-8b": 2048,
    "qwen2.5-7b": 2048,
    "qwen3-8b": 2048,
    "mistral-7b-v0.1": 8192,
    "qwen3-30b-a3b": 2048,
}
# 61 GB of bf16 weights: the default 0.82 of an 80 GB GPU would leave the KV cache ~3 GB.
GPU_MEMORY_UTILIZATION = {"qwen3-30b-a3b": 0.92}
WORKLOADS = {
    "w1": [
        "--random-input-len", "256", "--random-output-len", "64", "--random-range-ratio", "0.5",
        "--num-prompts", "100", "--max-concurrency", "16", "--num-warmups", "16",
    ],
    "batch1": [
        "--random-input-len", "256", "--random-output-len", "128", "--num-prompts", "8",
        "--max-concurrency", "1", "--num-warmups", "2",
    ],
}  # fmt: skip
KEPT = (
    "completed", "failed", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
    "median_itl_ms", "median_tpot_ms", "p99_itl_ms",
)  # fmt: skip


def truncate_tokenizer(tokenizer_json: Path, vocab_size: int, out: Path) -> None:
    """A byte-level BPE tokenizer with only the ids below `vocab_size` (and the merges that
    build them)."""
    data = json.loads(tokenizer_json.read_text())
    model = data["model"]
    vocab = {tok: i for tok, i in model["vocab"].items() if i < vocab_size}
    model["vocab"] = vocab
    merges = []
    for merge in model["merges"]:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(merge)
    model["merges"] = merges
    data["added_tokens"] = [t for t in data["added_tokens"] if t["id"] < vocab_size]
    out.write_text(json.dumps(data))


def model_dir(name: str, root: Path) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    config = json.loads((CONFIGS / name / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = CONFIGS / "tokenizer"
    shutil.copy(tokenizer / "tokenizer_config.json", folder)
    size = len(json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    if config["vocab_size"] < size:
        truncate_tokenizer(
            tokenizer / "tokenizer.json", config["vocab_size"], folder / "tokenizer.json"
        )
    else:
        shutil.copy(tokenizer / "tokenizer.json", folder)
    return folder


def run_model(name: str, max_len: int, root: Path, logs: Path) -> dict:
    """Start one server for the model, run each workload against it, stop it."""
    from inferengine.bench.systems import ServerProcess, free_port, trim_log, wait_until_healthy

    folder = model_dir(name, root)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cli = [sys.executable, "-m", "inferengine.entrypoints.cli.main"]
    serve = [
        *cli, "serve", str(folder), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", name, "--load-format", "dummy", "--max-model-len", str(max_len),
        "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION.get(name, 0.82)),
        "--disable-log-requests",
    ]  # fmt: skip
    log = logs / f"{name}-server.log"
    results: dict = {"max_model_len": max_len, "server": shlex.join(serve)}
    print("+", results["server"], flush=True)
    server = ServerProcess(shlex.join(serve), log)
    try:
        results["ready_s"] = wait_until_healthy(base_url, 600, server)
        for workload, args in WORKLOADS.items():
            command = [
                *cli, "bench", "serve", "--base-url", base_url, "--model", name,
                "--tokenizer", str(folder), "--ignore-eos", "--disable-tqdm", *args,
                "--save-result", "--result-dir", str(root), "--result-filename",
                f"{name}-{workload}.json",
            ]  # fmt: skip
            proc = subprocess.run(command, capture_output=True, text=True)
            path = root / f"{name}-{workload}.json"
            if proc.returncode == 0 and path.exists():
                summary = json.loads(path.read_text())
                results[workload] = {k: summary.get(k) for k in KEPT}
            else:
                results[workload] = {"error": (proc.stdout + proc.stderr)[-3000:]}
    except Exception as e:  # a model that fails to start is a result, not the end of the run
        results["error"] = f"{type(e).__name__}: {e}"
    finally:
        server.stop()
        trim_log(log, 80)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    import torch

    root = Path(tempfile.mkdtemp(prefix="model-shapes-"))
    logs = root / "logs"
    logs.mkdir()
    results = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "models": {m: run_model(m, MODELS[m], root, logs) for m in args.models},
    }
    folder = write_result_folder("model-shapes", results, args.out_dir)
    for log in sorted(logs.iterdir()):
        shutil.copy(log, folder / log.name)
    print(f"\n{'model':18} {'ready s':>8} {'W1 tok/s':>9} {'ITL ms':>7} {'b1 TPOT':>8} failed")
    for name, r in results["models"].items():
        w1, b1 = r.get("w1", {}), r.get("batch1", {})
        failed = (w1.get("failed") or 0) + (b1.get("failed") or 0)
        bad = "error" in r or "error" in w1 or "error" in b1 or failed
        print(
            f"{name:18} {r.get('ready_s') or 0:8.1f} {w1.get('output_throughput') or 0:9.0f} "
            f"{w1.get('median_itl_ms') or 0:7.2f} {b1.get('median_tpot_ms') or 0:8.2f} "
            f"{'FAILED' if bad else failed}"
        )
    print(f"results: {folder}")


if __name__ == "__main__":
    main()
