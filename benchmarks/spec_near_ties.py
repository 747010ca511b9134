"""Where greedy outputs with speculation part from those without, and how near a tie the choice
was there. In bf16 a verify step scores 1 + k positions at once, with other kernels and
reductions than a one-token decode, so a near-tie can tip either way; anything wider is a bug.

The grounded prompts run one at a time (batch 1, as `gpu_spec.sh` serves them) through `LLM`
without and with the speculative config, greedy. At each request's first differing position
the plain model's top-5 logprobs are read for the prefix (prompt + plain tokens so far), in the
model's dtype and in float32. Writes `benchmarks/results/<UTC stamp>-spec-near-ties/`; exits 1
if a divergence is wider than `--near-tie-nats` in the model's dtype.

    python benchmarks/spec_near_ties.py MODEL [--speculative-config JSON] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

PROMPTS = Path(__file__).resolve().parent / "data" / "grounded-smollm2.jsonl"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 12, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ (None if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def gap(top: dict[int, float], plain: int, spec: int) -> float | None:
    """logprob(plain token) - logprob(spec token), when both are among `top`."""
    return top[plain] - top[spec] if plain in top and spec in top else None


def _run(model: str, args, fn, **kwargs):
    """`fn(llm)` on a fresh engine (a third of the GPU's memory), which is then freed: four
    engines run one after another in this process."""
    import torch

    from inferengine import LLM

    if torch.cuda.is_available():
        kwargs.setdefault("gpu_memory_utilization", 0.3)
    llm = LLM(model, max_model_len=args.max_model_len, **kwargs)
    try:
        return fn(llm)
    finally:
        llm.llm_engine.core.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _generate(model: str, prompts: list[str], args, **kwargs) -> list[tuple[list, list]]:
    """Each prompt alone (batch 1): its token ids and the greedy output's."""
    from inferengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def generate(llm) -> list[tuple[list, list]]:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]

    return _run(model, args, generate, **kwargs)


def _top5(model: str, prefixes: list[list[int]], args, dtype: str) -> list[dict[int, float]]:
    from inferengine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)

    def top5(llm) -> list[dict[int, float]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prefixes], params, use_tqdm=False)
        return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]

    return _run(model, args, top5, dtype=dtype, enable_prefix_caching=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--speculative-config", default=NGRAM)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--near-tie-nats", type=float, default=0.5)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    spec_config = json.loads(args.speculative_config)
    prompt_ids, plain = zip(*_generate(args.model, prompts, args), strict=True)
    spec = [t for _, t in _generate(args.model, prompts, args, speculative_config=spec_config)]
    cases, prefix_only = [], []
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        j = first_divergence(a, b)
        if j is not None:
            cases.append({"request": i, "position": j, "plain": a[j], "spec": b[j]})
        elif len(a) != len(b):  # one stopped (a stop token) where the other went on
            prefix_only.append({"request": i, "plain_len": len(a), "spec_len": len(b)})
    if cases:
        prefixes = [prompt_ids[c["request"]] + plain[c["request"]][: c["position"]] for c in cases]
        for dtype in ("auto", "float32"):
            for case, top in zip(cases, _top5(args.model, prefixes, args, dtype), strict=True):
                key = "model_dtype" if dtype == "auto" else "float32"
                case[f"{key}_top5"] = sorted(top.items(), key=lambda kv: -kv[1])
                case[f"{key}_gap"] = gap(top, case["plain"], case["spec"])
                case[f"{key}_argmax"] = max(top, key=top.get)
    widest = max((abs(c["model_dtype_gap"]) for c in cases if c["model_dtype_gap"] is not None),
                 default=0.0)  # fmt: skip
    wide = [
        c
        for c in cases
        if c["model_dtype_gap"] is None or abs(c["model_dtype_gap"]) > args.near_tie_nats
    ]
    results = {
        "model": args.model,
        "speculative_config": spec_config,
        "requests": len(prompts),
        "identical": len(prompts) - len(cases) - len(prefix_only),
        "prefix_only": prefix_only,
        "output_tokens": {"plain": sum(map(len, plain)), "spec": sum(map(len, spec))},
        "near_tie_nats": args.near_tie_nats,
        "widest_model_dtype_gap": widest,
        "float32_picks": {
            "plain": sum(c["float32_argmax"] == c["plain"] for c in cases),
            "spec": sum(c["float32_argmax"] == c["spec"] for c in cases),
        },
        "all_near_ties": not wide,
        "cases": cases,
    }
    folder = write_result_folder("spec-near-ties", results, args.out_dir)
    print(json.dumps({k: v for k, v in results.items() if k != "cases"}, indent=1))
    print(f"wrote {folder}")
    return 0 if not wide else 1


if __name__ == "__main__":
    sys.exit(main())
