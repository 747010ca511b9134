"""Offline generation on the CPU: the engine against Transformers' `generate`, same prompts.

32 chat prompts × 128 new tokens (EOS ignored, greedy) on the default model. Transformers runs
both one prompt at a time (what a plain loop does) and as one left-padded batch. Writes
`benchmarks/results/<UTC stamp>-offline-cpu/` with the raw JSON, command and environment.

    python benchmarks/offline_cpu.py [--num-prompts 32] [--max-tokens 128] [--hf-single-prompts 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in simple words.",
    "Write a haiku about the sea.",
    "Give three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?",
]


def build_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (Question {i + 1}.)"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def run_engine(model: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from inferengine import LLM, SamplingParams

    llm = LLM(model)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


@torch.inference_mode()
def run_transformers(path: str, prompts: list[list[int]], max_tokens: int, batched: bool) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)
    start = time.perf_counter()
    tokens = 0
    if batched:
        width = max(len(p) for p in prompts)
        pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(ids, attention_mask=mask, pad_token_id=pad, **gen)
        tokens = (out.shape[1] - width) * len(prompts)
    else:
        for p in prompts:
            out = model.generate(torch.tensor([p]), **gen)
            tokens += out.shape[1] - len(p)
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "output_tokens": tokens, "output_tokens_per_s": tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--hf-single-prompts",
        type=int,
        default=8,
        help="prompts Transformers runs one at a time (its rate is measured on these)",
    )
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())

    from inferengine.engine.arg_utils import EngineArgs
    from inferengine.tokenizer import load_tokenizer

    path = EngineArgs(model=args.model).create_engine_config().model_config.model_path
    prompts = build_prompts(load_tokenizer(path), args.num_prompts)
    results = {
        "workload": {
            "model": args.model,
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "prompt_lengths": [len(p) for p in prompts],
            "dtype": "float32",
            "device": "cpu",
            "threads": torch.get_num_threads(),
        },
        "inferengine": run_engine(args.model, prompts, args.max_tokens),
        "transformers_batched": run_transformers(path, prompts, args.max_tokens, batched=True),
        "transformers_one_at_a_time": run_transformers(
            path, prompts[: args.hf_single_prompts], args.max_tokens, batched=False
        ),
    }
    ours = results["inferengine"]["output_tokens_per_s"]
    for name in ("transformers_batched", "transformers_one_at_a_time"):
        results[f"ratio_vs_{name}"] = ours / results[name]["output_tokens_per_s"]
    folder = write_result_folder("offline-cpu", results, args.out_dir)
    print(f"{'system':<30}{'output tok/s':>14}")
    for name in ("inferengine", "transformers_batched", "transformers_one_at_a_time"):
        print(f"{name:<30}{results[name]['output_tokens_per_s']:>14.1f}")
    print(json.dumps({k: v for k, v in results.items() if k.startswith("ratio")}, indent=1))
    print(f"results: {folder}")


if __name__ == "__main__":
    main()
