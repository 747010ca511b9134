"""Per-op profile of prefill: one long chunk and one mixed step under torch.profiler, summarised.

Builds the engine in this process (dummy weights at the model's shape, warm-up on), then runs
through its runner, on the null KV page like the warm-up, (a) one request prefilling a
`--chunk`-token prompt and (b) a mixed step of `--decodes` decodes at `--decode-context` beside
a `--mixed-chunk`-token chunk, each `--repeats` times under torch.profiler after one untimed run.
Per step it writes the kernels' time by kind (GEMM, attention, norm, rotary/KV store,
activation, sampling, other), GEMM and attention TFLOP/s from the model FLOPs of that step
(`inferengine/bench/mfu.py`'s counting), and the launch gaps (the device idle between the step's
first and last kernel). Run it in a call of its own, never beside a judged window.

    python benchmarks/prefill_profile.py --model configs/qwen2.5-7b --out DIR
    python benchmarks/prefill_profile.py --model configs/qwen2.5-7b --dry-run   # the plan
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inferengine.bench.environment import environment_text
from inferengine.bench.mfu import layer_matmul_params

KINDS = (
    ("attention", ("paged_attention", "merge_splits", "flash", "attn")),
    ("rotary/kv-store", ("rotary", "store_kv", "kv_store", "reshape_and_cache")),
    ("norm", ("rms", "norm")),
    ("activation", ("silu", "act_and_mul", "gelu")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90", "sm80", "wgmma")),
    ("sampling", ("sort", "argmax", "softmax", "topk", "exponential", "cumsum")),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def step_flops(config: dict, chunks: list[tuple[int, int]], sample_rows: int) -> dict:
    """GEMM and attention model FLOPs of one step: `chunks` are (context, new tokens) per
    request; the LM head runs on `sample_rows` rows."""
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    tokens = sum(n for _, n in chunks)
    gemm = 2 * layer_matmul_params(config) * layers * tokens
    gemm += 2 * config["hidden_size"] * config["vocab_size"] * sample_rows
    pairs = sum(n * ctx + n * (n + 1) // 2 for ctx, n in chunks)  # causal, after the context
    return {"tokens": tokens, "gemm": gemm, "attention": layers * 4 * heads * head_dim * pairs}


def plan(args: argparse.Namespace) -> dict[str, list[tuple[int, int]]]:
    mixed = [(args.decode_context, 1)] * args.decodes + [(0, args.mixed_chunk)]
    return {f"chunk {args.chunk}": [(0, args.chunk)], "mixed": mixed}


def summarise(kernels: list[tuple[str, float, float]], flops: dict, repeats: int) -> dict:
    """`kernels`: (name, start us, end us) of every device kernel of `repeats` runs of a step."""
    by_kind: dict[str, float] = {}
    for name, start, end in kernels:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + (end - start)
    per_run = {k: round(v / repeats / 1e3, 4) for k, v in sorted(by_kind.items())}  # ms
    busy = span = 0.0
    if kernels:
        ordered = sorted(kernels, key=lambda k: k[1])
        # Busy time: the union of kernel intervals; span: first start to last end per run.
        cur_s, cur_e = ordered[0][1], ordered[0][2]
        for _, s, e in ordered[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        span = sum(e - s for s, e in _runs(ordered, repeats))
    gemm_ms, attn_ms = per_run.get("gemm"), per_run.get("attention")
    return {
        **flops,
        "kernel_ms": per_run,
        "kernels_per_run": len(kernels) // max(repeats, 1),
        "gemm_tflops": flops["gemm"] / (gemm_ms * 1e-3) / 1e12 if gemm_ms else None,
        "attention_tflops": flops["attention"] / (attn_ms * 1e-3) / 1e12 if attn_ms else None,
        "span_ms": round(span / repeats / 1e3, 4),
        "launch_gaps_ms": round((span - busy) / repeats / 1e3, 4),
    }


def _runs(ordered: list[tuple[str, float, float]], repeats: int) -> list[tuple[float, float]]:
    """(start, end) of each run: the kernels split into `repeats` equal consecutive groups."""
    n = max(len(ordered) // max(repeats, 1), 1)
    groups = [ordered[i : i + n] for i in range(0, len(ordered), n)][:repeats]
    return [(g[0][1], max(k[2] for k in g)) for g in groups if g]


def profile(args: argparse.Namespace, config: dict) -> dict:
    import numpy as np
    import torch

    from inferengine.core.sched_output import SchedulerOutput
    from inferengine.engine.arg_utils import EngineArgs
    from inferengine.engine.llm_engine import LLMEngine
    from inferengine.worker.warm_up import WarmRequest, WarmStep, synthetic_step

    budget = max(args.chunk, args.mixed_chunk + args.decodes)
    engine_args = EngineArgs(
        model=args.model, load_format="dummy", max_model_len=args.max_model_len,
        max_num_batched_tokens=budget, max_num_seqs=max(args.decodes + 1, 2),
        device=args.device, warmup=True,
    )  # fmt: skip
    engine = LLMEngine(engine_args.create_engine_config())
    runner = engine.core.executor.worker.runner
    cuda = runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    rng = np.random.default_rng(0)
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "steps": {}}
    index = 0
    for label, chunks in plan(args).items():
        step = WarmStep(label, tuple(WarmRequest(c, n) for c, n in chunks))
        finished: set[str] = set()

        def run_once(step: WarmStep = step) -> None:
            nonlocal index, finished
            so = synthetic_step(runner, step, 10_000 + index, rng)
            so.finished_req_ids = finished
            runner.execute_model(so)
            finished, index = set(so.num_scheduled_tokens), index + 1

        run_once()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.repeats):
                run_once()
            if cuda:
                torch.cuda.synchronize()
        runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids=finished))
        device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
        kernels = [
            (e.name, e.time_range.start, e.time_range.end)
            for e in prof.events()
            if e.device_type == device_type and (cuda or not e.cpu_children)
        ]
        flops = step_flops(config, chunks, sample_rows=len(chunks))
        out["steps"][label] = summarise(kernels, flops, args.repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/qwen2.5-7b")
    parser.add_argument("--max-model-len", type=int, default=10240)
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument("--mixed-chunk", type=int, default=2048)
    parser.add_argument("--decodes", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", type=Path, help="folder for profile.json and environment.txt")
    parser.add_argument("--revision", help="the code revision measured (default: git here)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    config = json.loads(Path(args.model, "config.json").read_text(encoding="utf-8"))
    steps = {label: step_flops(config, chunks, len(chunks)) for label, chunks in plan(args).items()}
    if args.dry_run:
        print(json.dumps({"model": args.model, "repeats": args.repeats, "steps": steps}, indent=1))
        return 0
    result = {"model": args.model, "args": vars(args) | {"out": str(args.out)}}
    result |= profile(args, config)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "profile.json").write_text(text, encoding="utf-8")
        command = shlex.join([sys.executable, *sys.argv])
        env = environment_text({"profile": command}, args.revision)
        (args.out / "environment.txt").write_text(env, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
