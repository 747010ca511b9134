"""A first look at the engine on a GPU: start-up phases and a short greedy run, per setting.

Builds the engine on a dummy-weight model with CUDA graphs and async scheduling (and with
`--enforce-eager`), generates for a few mixed requests, and prints the start-up time and
output tokens/s. Exits non-zero if anything fails, so it is a cheap check before long runs.

    python benchmarks/gpu_smoke.py [--model configs/qwen2.5-7b] [--layers 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch


def shrunk_model(model: str, layers: int | None) -> str:
    """A copy of the model folder with fewer layers (same per-layer shapes)."""
    if not layers:
        return model
    out = Path(tempfile.mkdtemp()) / Path(model).name
    shutil.copytree(model, out, symlinks=False)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/qwen2.5-7b")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    from inferengine import LLM, SamplingParams

    model = shrunk_model(args.model, args.layers)
    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 30000, (n,), generator=g).tolist()}
        for n in (5, 300, 1200, 64, 17, 900, 2, 450)
    ]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokens = {}
    for name, kw in {"graphs+async": {}, "eager": {"enforce_eager": True}}.items():
        start = time.perf_counter()
        llm = LLM(
            model,
            load_format="dummy",
            max_model_len=4096,
            max_num_seqs=64,
            gpu_memory_utilization=0.35,
            **kw,
        )
        ready = time.perf_counter() - start
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        n = sum(len(t) for t in tokens[name])
        print(
            f"{name}: ready in {ready:.1f} s, {n} tokens in {elapsed:.2f} s ({n / elapsed:.0f} tok/s)"
        )
        del llm, outs
        gc.collect()
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(tokens["graphs+async"], tokens["eager"], strict=True))
    print(f"graphs+async vs eager: {same}/{len(prompts)} requests identical")


if __name__ == "__main__":
    main()
