"""Model FLOPs utilisation of a prefill-only run: model FLOPs per second over the measured bf16 peak.

The model FLOPs of one prompt of L tokens through a dense decoder (Llama, Mistral, Qwen2/3):

    matmuls    2 x (q, k, v, o, gate, up, down weights) x L per layer, times the layers
    attention  causal, per layer: QK^T and PV each 2 x heads x head_dim x L(L+1)/2
    LM head    2 x hidden x vocab, once: only the last position's logits are needed

Norms, rotary, activations and biases are left out (under 0.1% here). The peak is what
`torch.matmul` reaches on the same GPU in the same call (best of N at 8192^3 in bf16), not the
datasheet's; the figure is then "% of the measured bf16 matmul peak".

    python -m inferengine.bench.mfu peak        # prints {"bf16_matmul_tflops": ...} (CUDA)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from inferengine.bench.floor import DENSE_MODEL_TYPES

PEAK_SIZE = 8192
PEAK_REPEATS = 20


@dataclass(frozen=True)
class PromptFlops:
    matmul: int  # the layers' projections over every prompt token
    attention: int  # causal attention scores and weighted values
    lm_head: int  # one position's logits

    @property
    def total(self) -> int:
        return self.matmul + self.attention + self.lm_head


def layer_matmul_params(config: Mapping) -> int:
    """Weights of one layer's projections (q, k, v, o, gate, up, down)."""
    model_type = config.get("model_type")
    if model_type not in DENSE_MODEL_TYPES:
        raise ValueError(f"no FLOP count for model_type {model_type!r}")
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return h * q + 2 * h * kv + q * h + 3 * h * config["intermediate_size"]


def prompt_flops(config: Mapping, prompt_len: int) -> PromptFlops:
    """Model FLOPs of prefilling one prompt of `prompt_len` tokens (the whole model, all ranks)."""
    layers = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    causal_pairs = prompt_len * (prompt_len + 1) // 2
    return PromptFlops(
        matmul=2 * layer_matmul_params(config) * layers * prompt_len,
        attention=layers * 2 * (2 * heads * head_dim * causal_pairs),
        lm_head=2 * config["hidden_size"] * config["vocab_size"],
    )


def prefill_mfu(config: Mapping, result: Mapping, peak_tflops: float | None) -> dict:
    """The MFU of one prefill-only client result (`completed`, `total_input_tokens`,
    `duration`, as `vllm bench serve` writes them): every prompt's model FLOPs over the measured
    window, against `peak_tflops`. Prompts are taken at their mean length (they are equal in
    `prefill-only`)."""
    completed = result.get("completed") or 0
    duration = result.get("duration") or 0.0
    tokens = result.get("total_input_tokens") or 0
    if not completed or duration <= 0 or not tokens:
        return {"mfu_pct": None, "reason": "the run completed no prompt"}
    prompt_len = round(tokens / completed)
    per_prompt = prompt_flops(config, prompt_len)
    achieved = per_prompt.total * completed / duration / 1e12
    out = {
        "prompt_len": prompt_len,
        "prompts": completed,
        "duration_s": duration,
        "prompt_flops": {**asdict(per_prompt), "total": per_prompt.total},
        "attention_share": per_prompt.attention / per_prompt.total,
        "model_tflops_per_s": achieved,
        "peak_bf16_matmul_tflops": peak_tflops,
        "mfu_pct": 100 * achieved / peak_tflops if peak_tflops else None,
    }
    if not peak_tflops:
        out["reason"] = "no bf16 matmul peak measured in this call"
    return out


def bf16_matmul_peak_tflops(n: int = PEAK_SIZE, repeats: int = PEAK_REPEATS) -> float | None:
    """The best TFLOP/s of an n x n x n bf16 `torch.matmul` over `repeats` timed runs (after
    three untimed ones), on random inputs; None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b, out=out)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b, out
    torch.cuda.empty_cache()
    return 2 * n**3 / best / 1e12


def main(argv: list[str]) -> int:
    if argv != ["peak"]:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    peak = bf16_matmul_peak_tflops()
    print(json.dumps({"bf16_matmul_tflops": peak, "n": PEAK_SIZE, "repeats": PEAK_REPEATS}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
