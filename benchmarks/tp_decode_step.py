"""Decode step time under tensor parallelism: greedy fixed-length outputs on dummy weights.

One engine (`LLM(model, load_format="dummy", tensor_parallel_size=N)`) per run. For each batch
size it sends that many prompts of `--prompt-len` random token ids at once, temperature 0,
`ignore_eos`, exactly `--max-tokens` output tokens: a warm-up round, then `--repeats` rounds.
A request's decode step time is (last token time - first token time) / (output tokens - 1);
the figure is the median over requests and rounds. Writes
`benchmarks/results/<UTC stamp>-tp-decode-<model>-tp<N>/` (or `--out-dir`).

Greedy tokens of TP=2 against TP=1 are not compared here: dummy weights are drawn per rank, so
the two runs hold different models. The tests check that equality on real weights.

    python benchmarks/tp_decode_step.py --model configs/llama-3-70b --tp 2 [--batch 1 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

TOKEN_ID_LIMIT = 30_000  # below every benchmarked vocabulary and the shipped tokenizer's


def step_ms(output) -> float | None:
    """Milliseconds per decode step of one finished request, from its token times."""
    m = output.metrics
    n = len(output.outputs[0].token_ids)
    if m is None or m.first_token_time is None or m.last_token_time is None or n < 2:
        return None
    return (m.last_token_time - m.first_token_time) * 1e3 / (n - 1)


def run_batch(llm, batch: int, args: argparse.Namespace, rng: random.Random) -> dict:
    from inferengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    steps, walls = [], []
    for round_index in range(1 + args.repeats):
        prompts = [
            {"prompt_token_ids": [rng.randrange(TOKEN_ID_LIMIT) for _ in range(args.prompt_len)]}
            for _ in range(batch)
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        if any(len(o.outputs[0].token_ids) != args.max_tokens for o in outputs):
            raise RuntimeError(f"batch {batch}: an output is not {args.max_tokens} tokens long")
        if round_index == 0:
            continue  # warm-up
        walls.append(wall)
        steps.extend(s for s in (step_ms(o) for o in outputs) if s is not None)
    if not steps:
        raise RuntimeError("no request carried token times (RequestOutput.metrics)")
    result = {
        "decode_step_ms": round(statistics.median(steps), 3),
        "decode_step_ms_min_max": [round(min(steps), 3), round(max(steps), 3)],
        "round_wall_s": [round(w, 3) for w in walls],
        "output_tok_per_s": round(batch * args.max_tokens / statistics.median(walls), 1),
    }
    print(f"batch {batch}: {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/llama-3-70b", help="a config folder")
    parser.add_argument("--tp", type=int, default=2, help="tensor_parallel_size")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    parser.add_argument("--repeats", type=int, default=3, help="measured rounds per batch size")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    import torch

    from inferengine import LLM

    start = time.perf_counter()
    llm = LLM(
        args.model,
        load_format="dummy",
        tensor_parallel_size=args.tp,
        max_model_len=args.max_model_len,
        max_num_seqs=max(16, *args.batch),
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )
    ready_s = time.perf_counter() - start
    rng = random.Random(args.seed)
    batches = {str(b): run_batch(llm, b, args, rng) for b in args.batch}
    name = Path(args.model).name
    results = {
        "model": name,
        "tensor_parallel_size": args.tp,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus_visible": torch.cuda.device_count(),
        "load_format": "dummy",
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "max_model_len": args.max_model_len,
        "cuda_graphs": torch.cuda.is_available() and not args.enforce_eager,
        "engine_ready_s": round(ready_s, 1),
        "batches": batches,
    }
    folder = write_result_folder(f"tp-decode-{name}-tp{args.tp}", results, args.out_dir)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
