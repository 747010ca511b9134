"""The HTTP server's cost: one workload through `inferengine serve` (streaming) and `LLM.generate`.

    python benchmarks/api_overhead.py                      # tiny random model, CPU-friendly
    python benchmarks/api_overhead.py --model smollm2-135m-instruct --num-prompts 64

Both runs use the same engine settings, greedy decoding and `ignore_eos`, so each produces
exactly num_prompts x output_len tokens. Output tokens/s of each, and server / offline, are
printed and written under benchmarks/results/<UTC stamp>-api-overhead/.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

REPO = Path(__file__).resolve().parent.parent
BASE_PROMPT = "The quick brown fox jumps over the lazy dog. Hello world, how are you today?"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (a random Qwen3 built here) or a model")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each; the median counts")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache size, MiB")
    p.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for both runs (the server's engine core inherits it); "
        "1 avoids OpenMP spin-wait thrash on a small, busy CPU",
    )
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args()


def resolve_model(name: str, workdir: Path) -> str:
    if name != "tiny":
        return name
    sys.path.insert(0, str(REPO))
    from tests.conftest import build_checkpoint

    return str(build_checkpoint("qwen3", workdir / "tiny-qwen3"))


def prompts(n: int) -> list[str]:
    return [f"Request {i}: {BASE_PROMPT}" for i in range(n)]


# ---- offline ---------------------------------------------------------------------------------


def run_offline(model: str, args: argparse.Namespace) -> list[dict]:
    from inferengine import LLM, SamplingParams

    llm = LLM(model, max_model_len=args.max_model_len, kv_cache_memory=args.kv_cache_mib << 20)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts(2), params, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts(args.num_prompts), params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        runs.append({"elapsed_s": elapsed, "output_tokens": tokens})
    del llm
    gc.collect()
    return runs


# ---- through the server ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "inferengine.entrypoints.cli.main", "serve", model]
    cmd += ["--port", str(port), "--uvicorn-log-level", "warning", "--disable-log-requests"]
    cmd += [
        "--max-model-len",
        str(args.max_model_len),
        "--kv-cache-memory",
        f"{args.kv_cache_mib}MiB",
    ]
    proc = subprocess.Popen(
        cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start in 10 minutes")


async def stream_one(client, prompt: str, output_len: int) -> dict:
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, usage = time.perf_counter(), None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            if event["choices"] and first is None:
                first = time.perf_counter() - start
            usage = event.get("usage") or usage
    assert usage is not None
    return {"ttft_s": first, "output_tokens": usage["completion_tokens"]}


async def run_server_workload(url: str, args: argparse.Namespace) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=args.num_prompts + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as client:
        await asyncio.gather(*(stream_one(client, p, args.output_len) for p in prompts(2)))
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            results = await asyncio.gather(
                *(stream_one(client, p, args.output_len) for p in prompts(args.num_prompts))
            )
            elapsed = time.perf_counter() - start
            runs.append(
                {
                    "elapsed_s": elapsed,
                    "output_tokens": sum(r["output_tokens"] for r in results),
                    "mean_ttft_s": statistics.mean(r["ttft_s"] for r in results),
                }
            )
    return runs


def run_server(model: str, args: argparse.Namespace, workdir: Path) -> list[dict]:
    proc, url = start_server(model, args, workdir / "server.log")
    try:
        return asyncio.run(run_server_workload(url, args))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


# ---- results ---------------------------------------------------------------------------------


def summarize(runs: list[dict]) -> dict:
    rates = [r["output_tokens"] / r["elapsed_s"] for r in runs]
    return {"output_tokens_per_s": statistics.median(rates), "runs": runs}


def cpu_environment() -> str:
    """What the shared environment.txt leaves out and a CPU run depends on."""
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            ln.split(":", 1)[1].strip()
            for ln in cpuinfo.read_text().splitlines()
            if ln.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    return (
        f"cpu: {cpu} ({os.cpu_count()} logical cores)\n"
        f"load_average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
        f"torch_threads: {torch.get_num_threads()}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n"
    )


def main() -> None:
    args = parse_args()
    if args.torch_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)  # before torch is imported
    with tempfile.TemporaryDirectory(prefix="api-overhead-") as tmp:
        workdir = Path(tmp)
        model = resolve_model(args.model, workdir)
        offline = summarize(run_offline(model, args))
        server = summarize(run_server(model, args, workdir))
    ratio = server["output_tokens_per_s"] / offline["output_tokens_per_s"]
    print(f"offline LLM.generate : {offline['output_tokens_per_s']:9.1f} output tokens/s")
    print(f"server (streaming)   : {server['output_tokens_per_s']:9.1f} output tokens/s")
    print(f"server / offline     : {ratio:9.3f}")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    results = {"settings": settings, "offline": offline, "server": server, "ratio": ratio}
    out = write_result_folder("api-overhead", results, root=args.results_dir)
    with open(out / "environment.txt", "a") as f:
        f.write(cpu_environment())
    print(f"results: {out}")


if __name__ == "__main__":
    main()
