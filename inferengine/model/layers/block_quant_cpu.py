"""Linear layers and LM heads over GGUF-style block-quantized weights, run by our CPU kernels.

A weight is kept as its GGUF blocks of 32 input features: "q4" (4-bit values u with a scale
and an offset per block, w = scale · u + offset: GGUF's Q4_0, Q4_1, Q4_K exactly) or "q8"
(int8 values q with a scale per block, w = scale · q: Q8_0 and Q5_0 exactly). The kernels
(`kernels/cpu_native.py`, `kernels/csrc/qgemm.cpp`) quantize the activations in the same
blocks into two int8 terms (about 15 bits) and multiply with integer dot products: a decode
step reads the weights' 4.5 to 8.5 bits each instead of 16 or 32, and that rounding of the
activations is the one numeric difference from the dequantized model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inferengine.kernels import cpu_native
from inferengine.kernels.cpu_native import BLOCK

KINDS = ("q4", "q8")


@dataclass(frozen=True)
class BlockQuantWeight:
    """One weight [N, K] in blocks of 32 input features: `kind` "q4" (values uint8 0..15,
    w = scale · u + offset) or "q8" (values int8 -127..127, w = scale · q, offset None);
    scale and offset float32 [N, K / 32]."""

    kind: str
    values: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS or (self.offset is None) != (self.kind == "q8"):
            raise ValueError(f"a {self.kind!r} block weight needs an offset iff it is q4")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.values.shape[0]), int(self.values.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        n, k = self.shape
        w = self.values.view(n, k // BLOCK, BLOCK).float() * self.scale.unsqueeze(-1)
        if self.offset is not None:
            w = w + self.offset.unsqueeze(-1)
        return w.reshape(n, k)

    @staticmethod
    def stack_rows(parts: list[BlockQuantWeight]) -> BlockQuantWeight | None:
        """One weight of the parts' rows in order (the shards of a fused qkv or gate_up), or
        None when the parts are of different kinds."""
        if len({p.kind for p in parts}) != 1:
            return None
        if len(parts) == 1:
            return parts[0]

        def cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if tensors[0] is None else torch.cat(tensors, dim=0)

        return BlockQuantWeight(
            parts[0].kind,
            cat([p.values for p in parts]),
            cat([p.scale for p in parts]),
            cat([p.offset for p in parts]),
        )


def fits_kernels(shape: tuple[int, int]) -> bool:
    n, k = shape
    return n > 0 and k > 0 and k % BLOCK == 0


class _Packed:
    """A weight as the kernel of its kind reads it. `owner` holds the tensors as buffers (so
    they count as the module's); the matmul keeps its own references, as a decode step calls
    it a hundred times and more (the model is built on its device and never moved)."""

    def __init__(self, owner: nn.Module, weight: BlockQuantWeight):
        if not fits_kernels(weight.shape):
            raise ValueError(f"block weights need K a multiple of {BLOCK}; got {weight.shape}")
        ops = cpu_native.native_ops()
        if ops is None:
            raise RuntimeError(
                f"our CPU kernels are unavailable: {cpu_native.unavailable_reason()}"
            )
        self.out_features, self.in_features = weight.shape
        if weight.kind == "q4":
            assert weight.offset is not None
            self.tensors = cpu_native.pack_q4(weight.values, weight.scale, weight.offset)
            names = ("weight_packed", "weight_scale", "weight_offset")
            self.kernel = ops.qlinear_q4
        else:
            self.tensors = cpu_native.pack_q8(weight.values, weight.scale)
            names = ("weight_packed", "weight_corr", "weight_scale")
            self.kernel = ops.qlinear_q8
        for name, tensor in zip(names, self.tensors, strict=True):
            owner.register_buffer(name, tensor, persistent=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype not in (torch.float32, torch.bfloat16) or not rows.is_contiguous():
            rows = rows.float().contiguous()
        if bias is not None and bias.dtype != rows.dtype:
            bias = bias.to(rows.dtype)
        y = self.kernel(rows, *self.tensors, bias, self.out_features, cpu_native.ACTIVATION_TERMS)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)


class BlockQuantLinearMethod:
    """A linear layer's `quant_method` over a block-quantized weight (read when the layer is
    built, e.g. from a GGUF): the layer holds the packed buffers and no float weight."""

    def __init__(self, weight: BlockQuantWeight):
        self.weight: BlockQuantWeight | None = weight  # until packed into the layer
        self.packed: _Packed | None = None

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        assert self.weight is not None, "a block-quantized method serves one layer"
        if self.weight.shape != (sum(output_sizes), input_size):
            raise ValueError(
                f"block weight {self.weight.shape} does not fit the layer's weight "
                f"{(sum(output_sizes), input_size)}"
            )
        self.packed = _Packed(layer, self.weight)
        self.weight = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        assert self.packed is not None
        return self.packed.matmul(x, bias)

    def process_after_loading(self, layer: nn.Module) -> None:
        pass


class BlockQuantLMHead(nn.Module):
    """An LM head over a block-quantized weight. One tied to the embedding keeps the dense
    weight it shares (as `weight`, which the lookups read); the logits come from the blocks
    either way."""

    def __init__(self, vocab_size: int, weight: BlockQuantWeight, tied: nn.Parameter | None):
        super().__init__()
        self.vocab_size = vocab_size
        self.packed = _Packed(self, weight)
        self.weight = tied

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.packed.matmul(hidden, None)[..., : self.vocab_size]


class BlockQuantEmbedding(nn.Module):
    """A token embedding over a block-quantized weight (an untied one, or the table an LM head
    shares): each row looked up is dequantized, exactly to the GGUF's float32 values, then cast
    to `dtype`, so the table stays at its 4.5 to 8.5 bits a weight."""

    def __init__(self, weight: BlockQuantWeight, dtype: torch.dtype):
        super().__init__()
        self.kind = weight.kind
        self.vocab_size, self.hidden_size = weight.shape
        self.dtype = dtype
        self.register_buffer("values", weight.values, persistent=False)
        self.register_buffer("scale", weight.scale, persistent=False)
        self.register_buffer("offset", weight.offset, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        offset = None if self.offset is None else self.offset[ids]
        rows = BlockQuantWeight(self.kind, self.values[ids], self.scale[ids], offset)
        return rows.dequantize().to(self.dtype).view(*input_ids.shape, self.hidden_size)
