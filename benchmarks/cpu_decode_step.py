"""Decode-step time on the CPU: a GGUF's weights as the engine loads them by default (kept
quantized and run by our C++ kernels; where those cannot be built, float16 under fbgemm's GEMM
on x86), in float32 and in bfloat16 activations, against
dequantized bf16 and float32, one engine each, measured in turns so that a busy machine slows
them alike.

Each measurement generates `--short` and `--long` tokens greedily (EOS ignored) for `batch`
copies of one prompt and divides the time difference by the token difference: prefill and
start-up cancel out, what remains is one decode step. Every one of `--rounds` turns is kept;
the median is quoted.
Writes `benchmarks/results/<UTC stamp>-cpu-decode-step/`.

    python benchmarks/cpu_decode_step.py [--model smollm2-135m-instruct] [--batch 1 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

CONFIGS = {
    "default": {},  # our kernels over the GGUF's blocks, float32 activations
    "default-bf16": {"dtype": "bfloat16"},
    "dense-bf16": {"gguf_dequantize": True, "dtype": "bfloat16"},
    "dense-float32": {"gguf_dequantize": True, "dtype": "float32"},
}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def step_seconds(llm, prompt_ids: list[int], batch: int, short: int, long: int) -> float:
    from inferengine import SamplingParams

    def run(tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": [*prompt_ids, i]} for i in range(batch)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return (run(long) - run(short)) / (long - short)


def weight_kinds(llm) -> dict[str, int]:
    """How many linear layers (and heads) hold each kind of weight: what `default` became."""
    from collections import Counter

    model = llm.llm_engine.core.executor.worker.runner.model
    kinds: Counter[str] = Counter()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            kinds[type(method).__name__] += 1
        elif type(module).__name__.endswith("LMHead"):
            kinds[type(module).__name__] += 1
    return dict(kinds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=36)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()

    import torch

    from inferengine import LLM

    llms = {
        name: LLM(args.model, max_model_len=512, kv_cache_memory=256 << 20, **CONFIGS[name])
        for name in args.configs
    }
    tokenizer = next(iter(llms.values())).get_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    runs: dict[str, dict[int, list[float]]] = {name: {b: [] for b in args.batch} for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            for batch in args.batch:
                runs[name][batch].append(
                    step_seconds(llm, prompt_ids, batch, args.short, args.long)
                )
    median = {n: {b: statistics.median(v) for b, v in by.items()} for n, by in runs.items()}
    results = {
        "workload": vars(args) | {"prompt_tokens": len(prompt_ids)},
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "configs": {name: CONFIGS[name] for name in llms},
        "weights": {name: weight_kinds(llm) for name, llm in llms.items()},
        "step_ms_median": {n: {b: s * 1e3 for b, s in by.items()} for n, by in median.items()},
        "step_ms_runs": {
            n: {b: [s * 1e3 for s in v] for b, v in by.items()} for n, by in runs.items()
        },
        "tokens_per_s_median": {n: {b: b / s for b, s in by.items()} for n, by in median.items()},
    }
    folder = write_result_folder("cpu-decode-step", results, args.out_dir)
    print(f"{'weights':<15}{'batch':>6}{'ms/step (median; every turn)':>40}")
    for name, by in runs.items():
        for batch, values in by.items():
            every = ", ".join(f"{v * 1e3:.1f}" for v in values)
            print(f"{name:<15}{batch:>6}{median[name][batch] * 1e3:>10.1f}  ({every})")
    print(f"results: {folder}")


if __name__ == "__main__":
    main()
