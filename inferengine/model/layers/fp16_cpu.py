"""Float16 weights under float32 CPU matmuls, on fbgemm's packed fp16 GEMM (x86).

Where our CPU kernels (`layers/block_quant_cpu.py`) cannot be built, or a GGUF's types are
not ones they take, its weights load dequantized, and a decode step would read 4 bytes a
weight in float32. fbgemm keeps each weight as
float16, packed for its GEMM, converts it in registers and accumulates in float32: half the
bytes, with activations, outputs and every other op still float32. Rounding a dequantized
GGUF weight to float16 moves it by at most 2^-11 of itself, far below the 4- or 8-bit
quantization it came from.

Measured on 2 AVX2 cores (one row, weights streamed from memory as in a step): 1536 x 576 takes
90 µs against float32's 331; SmolLM2-135M's 49152 x 576 head 2.3 ms against 9.0. From 64 rows
up to 2048 the layers' shapes run at float32's speed or better, so prefill keeps it too; only
the LM head over hundreds of rows is slower, and it sees one row per sampled sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from inferengine.model.layers.linear import UNQUANTIZED, ColumnParallelLinear, RowParallelLinear
from inferengine.model.layers.vocab import ParallelLMHead


def fp16_gemm_available() -> bool:
    """torch was built with fbgemm (x86) and its packed fp16 linear ops."""
    ops = torch.ops.quantized
    return (
        "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(ops, "linear_prepack_fp16")
        and hasattr(ops, "linear_dynamic_fp16")
    )


def _pack(weight: torch.Tensor) -> object:
    return torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)


def _matmul(x: torch.Tensor, packed: object, out_features: int) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32:
        rows = rows.float()
    y = torch.ops.quantized.linear_dynamic_fp16(rows, packed)
    if y.dtype != x.dtype:
        y = y.to(x.dtype)
    return y.view(*x.shape[:-1], out_features)


class Fp16PackedLinearMethod:
    """A linear layer's `quant_method` holding its weight as fbgemm-packed float16; the float
    weight parameter is dropped (the packed object is not a tensor, so the method keeps it)."""

    def __init__(self, layer: nn.Module):
        self.out_features = int(layer.weight.shape[0])
        self.packed = _pack(layer.weight)
        del layer._parameters["weight"]

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = _matmul(x, self.packed, self.out_features)
        return y if bias is None else y + bias


class Fp16PackedLMHead(nn.Module):
    """An LM head over an fbgemm-packed float16 copy of its weight. A tied head keeps the
    float32 weight it shares with the embedding (as `weight`, which the lookups read)."""

    def __init__(self, vocab_size: int, weight: torch.Tensor, tied: bool):
        super().__init__()
        self.vocab_size = vocab_size
        self.out_features = int(weight.shape[0])
        self.packed = _pack(weight)
        self.weight = weight if tied else None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _matmul(hidden, self.packed, self.out_features)[..., : self.vocab_size]


def pack_linears_fp16(model: nn.Module) -> int:
    """Give every unquantized float32 linear layer of `model`, and its LM head, float16 packed
    weights; return how many layers took them."""
    count = 0
    for module in model.modules():
        if (
            isinstance(module, ColumnParallelLinear | RowParallelLinear)
            and module.quant_method is UNQUANTIZED
            and module.weight.dtype == torch.float32
        ):
            module.quant_method = Fp16PackedLinearMethod(module)
            count += 1
    head = getattr(model, "lm_head", None)
    if isinstance(head, ParallelLMHead) and head.weight.dtype == torch.float32:
        embedding = getattr(getattr(model, "model", None), "embed_tokens", None)
        tied = embedding is not None and getattr(embedding, "weight", None) is head.weight
        model.lm_head = Fp16PackedLMHead(head.vocab_size, head.weight, tied)
        count += 1
    return count
