"""Greedy agreement on the GPU: torch vs Triton attention, and CUDA graphs vs eager (bf16).

A mixed batch of requests (short and long prompts, shared prefixes, different output lengths)
runs greedily through the engine under each setting on the same random weights. For each pair
of settings it reports how many requests agree token for token, and where one diverges, the
reference's logit margin between its top two tokens at that position (a near-tie in bf16 is the
expected reason). Writes `benchmarks/results/<UTC stamp>-gpu-equivalence/`.

    python benchmarks/gpu_equivalence.py [--model configs/qwen2.5-7b] [--num-requests 32]
        [--extra]  # also flex, and --attention-backend-benchmark, each against torch
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

SETTINGS = {
    "torch-eager": dict(attention_backend="torch", enforce_eager=True),
    "triton-eager": dict(attention_backend="triton", enforce_eager=True),
    "triton-graphs": dict(attention_backend="triton", enforce_eager=False),
    # --extra: FlexAttention, and the start-up benchmark choosing among the usable backends
    "flex-eager": dict(attention_backend="flex", enforce_eager=True),
    "auto-benchmark": dict(attention_backend="auto", attention_backend_benchmark=True),
}
BASE_SETTINGS = ("torch-eager", "triton-eager", "triton-graphs")


def workload(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (300,), generator=g).tolist()
    prompts, lengths = [], []
    for i in range(n):
        size = [1, 7, 33, 130, 600, 1500, 4000][i % 7]
        tail = torch.randint(0, vocab, (size,), generator=g).tolist()
        prompts.append(shared + tail if i % 3 == 0 else tail)
        lengths.append(8 + (i * 13) % 57)
    return prompts, lengths


def run(model: str, setting: dict, prompts, lengths, max_num_seqs: int, dtype: str):
    """Token ids per request, per position the margin between the top two logprobs, and the
    attention backend the engine ran with (with the start-up benchmark's timings, if any)."""
    from inferengine import LLM, SamplingParams
    from inferengine.outputs import top_two_margin

    llm = LLM(
        model,
        load_format="dummy",
        dtype=dtype,
        max_model_len=8192,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        # Engines run one after another in this process; each takes its share.
        gpu_memory_utilization=0.28 if dtype == "bfloat16" else 0.55,
        **setting,
    )
    params = [
        SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for m in lengths
    ]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    executor = llm.llm_engine.core.executor
    backend = {
        "name": executor.attention_backend_name,
        "startup_benchmark_ms": executor.attention_backend_timings_ms,
    }
    del llm, executor
    gc.collect()
    torch.cuda.empty_cache()
    tokens = [o.outputs[0].token_ids for o in outputs]
    margins = [[top_two_margin(e) for e in o.outputs[0].logprobs or []] for o in outputs]
    return tokens, margins, backend


def compare(a: list[list[int]], b: list[list[int]], margins: list[list[float | None]]) -> dict:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    first_diff = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            pos = next(j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v)
            first_diff.append(
                {
                    "request": i,
                    "position": pos,
                    "tokens": [x[pos], y[pos]],
                    "reference_top2_logprob_margin": margins[i][pos],
                }
            )
    total = sum(len(x) for x in a)
    agree_tokens = sum(
        next((j for j, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), len(x))
        for x, y in zip(a, b, strict=True)
    )
    return {
        "requests_identical": same,
        "requests": len(a),
        "agreement_rate": same / len(a),
        "tokens_before_first_divergence_rate": agree_tokens / total,
        "divergences": first_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/qwen2.5-7b")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out-dir", default=None)
    parser.add_argument(
        "--extra", action="store_true",
        help="also run the flex backend and --attention-backend-benchmark against torch",
    )  # fmt: skip
    args = parser.parse_args()
    from inferengine.engine.arg_utils import EngineArgs

    vocab = EngineArgs(model=args.model).create_engine_config().model_config.vocab_size
    prompts, lengths = workload(args.num_requests, vocab)
    names = list(SETTINGS) if args.extra else list(BASE_SETTINGS)
    runs = {
        name: run(args.model, SETTINGS[name], prompts, lengths, args.max_num_seqs, args.dtype)
        for name in names
    }
    tokens = {name: r[0] for name, r in runs.items()}
    results = {
        "model": args.model,
        "dtype": args.dtype,
        "weights": "dummy (random normal, seed 0)",
        "prompt_lengths": [len(p) for p in prompts],
        "max_tokens": lengths,
        "triton_vs_torch": compare(
            tokens["torch-eager"], tokens["triton-eager"], runs["torch-eager"][1]
        ),
        "graphs_vs_eager": compare(
            tokens["triton-eager"], tokens["triton-graphs"], runs["triton-eager"][1]
        ),
        "backends": {name: r[2] for name, r in runs.items()},
        "tokens": tokens,
    }
    for name in names[len(BASE_SETTINGS) :]:
        results[f"{name}_vs_torch"] = compare(
            tokens["torch-eager"], tokens[name], runs["torch-eager"][1]
        )
    folder = write_result_folder(f"gpu-equivalence-{args.dtype}", results, args.out_dir)
    for key in [k for k in results if k.endswith(("_vs_torch", "_vs_eager"))]:
        r = results[key]
        print(
            f"{key}: {r['requests_identical']}/{r['requests']} requests identical, "
            f"{r['tokens_before_first_divergence_rate']:.4f} of tokens before a divergence"
        )
    print("backends:", results["backends"])
    print(f"results: {folder}")


if __name__ == "__main__":
    main()
