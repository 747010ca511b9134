"""FP8 against the unquantized model at a real shape: argmax agreement and KL divergence of the
next-token distributions, teacher-forced on random prompts.

Both models hold the same weights before quantization (dummy weights draw the same values for
the same seed; or give a real checkpoint with --load-format auto). Measured where each FP8 path
runs: at every prompt position of batched prefills (M in the thousands: per-token activations
and `torch._scaled_mm`) and at decode steps of all prompts together (M = --prompts <= 32: the
W8A16 skinny kernel), each step feeding both models the unquantized model's greedy token. The
issue's bar is argmax agreement >= 0.99. Writes `benchmarks/results/<UTC stamp>-fp8-accuracy/`
(or --out-dir).

    python benchmarks/fp8_accuracy.py [--model configs/qwen2.5-7b] [--load-format dummy]
        [--prompts 16] [--prompt-len 256] [--decode-steps 32] [--fp32-floor] [--emulate-cuda]
        [--out-dir DIR]

Random (dummy) weights leave most next-token choices near ties (top-two margins of a few
hundredths of a nat), which any rounding flips; so agreement is also reported over the
positions whose reference margin is at least 0.05 ... 0.5 nats, and --fp32-floor compares a
float32 copy of the reference too, the floor that bf16 rounding alone sets. `fp8-grid` is the
reference with its FP8-quantized weights rounded to their FP8 values (what the weights' rounding
alone costs), and `kernels` compares FP8 with it (what our kernels and the activation
quantization add; on the CPU it reads 1.0 by construction unless --emulate-cuda runs the CUDA
paths' arithmetic in the torch reference: W8A16 up to `fp8_gemm.use_w8a16`'s M, W8A8 above,
for shapes whose dimensions are multiples of 16, as every configs/ model's are). Real weights:
--model a GGUF file or folder with --load-format auto. With --fp32-floor a 7B shape holds four
7B models: more than an 80 GB GPU has (run it once with the floor, once without).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

from inferengine.attention.metadata import AttentionMetadata
from inferengine.attention.selector import get_attention_backend
from inferengine.engine.arg_utils import EngineArgs
from inferengine.kernels import fp8_gemm
from inferengine.kernels.fp8_gemm import FP8_DTYPE, dequantize_rows
from inferengine.model.loader.loader import TORCH_DTYPES, load_model
from inferengine.model.quantization import fp8 as fp8_method
from inferengine.model.quantization.compare import (
    agreement_by_margin,
    position_stats,
    summarize,
)

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 16
PREFILL_TOKENS = 2048  # tokens per prefill forward (bounds the [tokens, vocab] logits)
PHASES = ("prefill", "decode")
MARGINS = (0.0, 0.05, 0.1, 0.2, 0.5)  # nats between the reference's top two tokens


class Batch:
    """Sequences with consecutive KV pages each; one model's caches per model."""

    def __init__(self, num_seqs: int, max_len: int, device: torch.device):
        self.device = device
        self.blocks_per_seq = -(-max_len // BLOCK)
        self.num_blocks = 1 + num_seqs * self.blocks_per_seq
        table = torch.arange(num_seqs * self.blocks_per_seq, dtype=torch.int32) + 1
        self.table = table.view(num_seqs, self.blocks_per_seq)
        self.lengths = [0] * num_seqs

    def caches(self, model_config, dtype: torch.dtype) -> list[torch.Tensor]:
        shape = (2, self.num_blocks, BLOCK, model_config.num_kv_heads, model_config.head_dim)
        return [
            torch.zeros(shape, dtype=dtype, device=self.device)
            for _ in range(model_config.num_layers)
        ]

    def step(self, seqs: list[int], tokens: list[list[int]]) -> tuple:
        """(input ids, positions, metadata) running `tokens[i]` next in sequence `seqs[i]`."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, new in zip(seqs, tokens, strict=True):
            start = self.lengths[seq]
            for i, token in enumerate(new):
                p = start + i
                ids.append(token)
                positions.append(p)
                slots.append(int(self.table[seq, p // BLOCK]) * BLOCK + p % BLOCK)
            self.lengths[seq] += len(new)
            starts.append(len(ids))
            seq_lens.append(self.lengths[seq])
        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=len(ids),
            max_query_len=max(len(t) for t in tokens),
            max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_table=self.table[seqs].to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            min_query_len=min(len(t) for t in tokens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        ids_t = torch.tensor(ids, device=dev)
        return ids_t, torch.tensor(positions, device=dev), metadata


@torch.no_grad()
def logits(model, caches, inputs) -> torch.Tensor:
    ids, positions, metadata = inputs
    return model.compute_logits(model(ids, positions, caches, metadata)).float()


def model_config(args: argparse.Namespace, quantization: str | None, dtype: str | None = None):
    engine_args = EngineArgs(
        model=args.model,
        load_format=args.load_format,
        dtype=dtype or args.dtype,
        max_model_len=args.prompt_len + args.decode_steps,
        quantization=quantization,
        seed=args.seed,
        gguf_dequantize=True,  # a GGUF's weights dense in every model, as FP8 quantizes them
    )
    return engine_args.create_engine_config().model_config


def load_all(args: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """(name -> model config, name -> model): the reference, FP8, `fp8-grid` (the reference
    with each weight that FP8 quantizes replaced by its FP8 value, multiplied in 16 bits: what
    the quantization alone costs, without our kernels or activation quantization), and with
    --fp32-floor a float32 copy of the reference's very weights (how far mere rounding moves
    the argmax)."""
    configs = {
        "reference": model_config(args, None),
        "fp8": model_config(args, "fp8"),
        "fp8-grid": model_config(args, None),
    }
    if args.fp32_floor:
        configs["float32"] = model_config(args, None, "float32")
    backend = get_attention_backend("auto", device.type)
    models = {name: load_model(c, device, backend) for name, c in configs.items()}
    with torch.no_grad():
        if "float32" in models:
            reference = dict(models["reference"].named_parameters())
            for name, mine in models["float32"].named_parameters():
                mine.copy_(reference[name])
        fp8 = dict(models["fp8"].named_parameters())
        grid = dict(models["fp8-grid"].named_parameters())
        for name, weight in fp8.items():
            if weight.dtype == FP8_DTYPE:
                scale = fp8[name.removesuffix("weight") + "weight_scale"]
                grid[name].copy_(dequantize_rows(weight, scale, grid[name].dtype))
    return configs, models


def emulate_cuda_paths() -> None:
    """Off CUDA, FP8 layers multiply as the CUDA paths do, in the torch reference: W8A16 up to
    `fp8_gemm.use_w8a16`'s M, above it activations quantized per token (W8A8)."""

    def linear(x, weight, weight_scale, bias=None):
        n, k = weight.shape
        w8a8 = not fp8_gemm.use_w8a16(x.numel() // k, n, k)
        return fp8_gemm.fp8_linear_ref(x, weight, weight_scale, bias, quantize_input=w8a8)

    fp8_method.fp8_linear = linear


def measure(args: argparse.Namespace) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.emulate_cuda and device.type != "cuda":
        emulate_cuda_paths()
    started = time.perf_counter()
    configs, models = load_all(args, device)
    load_s = time.perf_counter() - started
    reference = configs["reference"]
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.prompts, args.prompt_len)
    prompts = torch.randint(0, reference.vocab_size, shape, generator=g).tolist()
    batch = Batch(args.prompts, args.prompt_len + args.decode_steps, device)
    caches = {name: batch.caches(c, TORCH_DTYPES[c.dtype]) for name, c in configs.items()}
    # (row name, reference model, candidate model); "kernels" isolates our FP8 kernels'
    # (and activation quantization's) error from the weights' rounding.
    pairs = [(name, "reference", name) for name in models if name != "reference"]
    pairs.append(("kernels", "fp8-grid", "fp8"))
    candidates = [name for name, _, _ in pairs]
    rows: dict[tuple[str, str], list] = {}

    def run(inputs: tuple, phase: str) -> torch.Tensor:
        """The reference's logits; each pair's comparison recorded."""
        out = {name: logits(models[name], caches[name], inputs) for name in models}
        for row, ref_name, cand_name in pairs:
            stats = position_stats(out[ref_name], out[cand_name])
            rows.setdefault((row, phase), []).append([t.cpu() for t in stats])
        return out["reference"]

    last = []
    per_forward = max(1, PREFILL_TOKENS // args.prompt_len)
    for first in range(0, args.prompts, per_forward):
        seqs = list(range(first, min(first + per_forward, args.prompts)))
        inputs = batch.step(seqs, [prompts[s] for s in seqs])
        ref = run(inputs, "prefill")
        last.append(ref[inputs[2].query_start_loc[1:].long() - 1].argmax(dim=-1).cpu())
    next_tokens = torch.cat(last).tolist()
    seqs = list(range(args.prompts))
    for _ in range(args.decode_steps):
        next_tokens = (
            run(batch.step(seqs, [[t] for t in next_tokens]), "decode").argmax(-1).tolist()
        )
    results = {
        "model": args.model,
        "architecture": reference.architecture,
        "load_format": args.load_format,
        "dtype": reference.dtype,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "decode_steps": args.decode_steps,
        "seed": args.seed,
        "load_s": load_s,
        "emulated_cuda_paths": bool(args.emulate_cuda and device.type != "cuda"),
    }
    results["pairs"] = {row: [ref, cand] for row, ref, cand in pairs}
    for name in candidates:
        phases = {p: [torch.cat(c) for c in zip(*rows[(name, p)], strict=True)] for p in PHASES}
        every = [torch.cat(parts) for parts in zip(*phases.values(), strict=True)]
        results[name] = {
            **{p: summarize(kl, agree).as_dict() for p, (kl, agree, _) in phases.items()},
            "all": summarize(every[0], every[1]).as_dict(),
            "by_margin": agreement_by_margin(every[1], every[2], MARGINS),
        }
    results["fp8_meets_0.99_argmax"] = results["fp8"]["all"]["argmax_agreement"] >= 0.99
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(ROOT / "configs" / "qwen2.5-7b"))
    parser.add_argument("--load-format", default="dummy", choices=("dummy", "auto"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--prompts", type=int, default=16, help="at most 32: decode is W8A16")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fp32-floor", action="store_true", help="also compare a float32 copy of the reference"
    )
    parser.add_argument(
        "--emulate-cuda",
        action="store_true",
        help="off CUDA, quantize activations per token above the W8A16 M as CUDA does",
    )
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    results = measure(args)
    for name in results["pairs"]:
        for part in (*PHASES, "all"):
            r = results[name][part]
            print(
                f"{name} {part:>7}: {r['positions']} positions, argmax agreement "
                f"{r['argmax_agreement']:.4f}, KL mean {r['mean_kl']:.2e} p99 {r['p99_kl']:.2e} "
                f"max {r['max_kl']:.2e}"
            )
        for row in results.get(name, {}).get("by_margin", []):
            print(
                f"{name} margin >= {row['min_margin']}: {row['positions']} positions, "
                f"argmax agreement {row['argmax_agreement']:.4f}"
            )
    print(write_result_folder("fp8-accuracy", results, args.out_dir))


if __name__ == "__main__":
    main()
