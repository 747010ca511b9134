"""Int4/int8 weight-only accuracy on a real model: SmolLM2-135M (the default model, its GGUF
dequantized to float32; `--model` for another cached folder) quantized round-to-nearest into
each format's layout (`tests/model/quantization/int_checkpoints.py`), loaded by the engine and
scored teacher-forced on the float model's greedy continuations: argmax agreement and KL.

    python benchmarks/int4_accuracy.py awq:64 gptq:64:8 [--model FOLDER]

Writes `benchmarks/results/<UTC stamp>-int4-accuracy-cpu/`. Several minutes on a CPU (each
matmul dequantizes its weight); the GPU session runs it with the Triton kernels.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from result_folder import write_result_folder

from tests.model.quantization.accuracy import (
    cached_default_model,
    float_reference,
    measure,
    parse_scheme,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("schemes", nargs="*", default=["awq:64", "gptq:64:8"])
    parser.add_argument("--model", default=None, help="a model folder (default: the cached "
                        "default model)")  # fmt: skip
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    folder = Path(args.model) if args.model else cached_default_model()
    if folder is None:
        sys.exit("the default model is not cached: run `inferengine generate` once first")
    reference = float_reference(folder)
    results = {"model": str(folder.name), "positions_per_scheme": None, "schemes": {}}
    for spec in args.schemes:
        with tempfile.TemporaryDirectory() as tmp:
            stats = measure(folder, Path(tmp) / "q", parse_scheme(spec), reference)
        print(spec, stats, flush=True)
        results["schemes"][spec] = stats.as_dict()
        results["positions_per_scheme"] = stats.positions
    print(write_result_folder("int4-accuracy-cpu", results, args.out_dir))


if __name__ == "__main__":
    main()
