"""Weight-only int4 linear layers on the CPU, on torch's packed int4 kernel.

A weight is int4 values `q` (0..15) in groups of `INT4_GROUP` input features, each group with a
scale and a zero: `w = (q - 8) * scale + zero`, the form `aten._weight_int4pack_mm_for_cpu`
multiplies with (it dequantizes group by group inside the matmul, so the weights stay 4-bit in
memory). GGUF's Q4_0, Q4_1 and Q4_K blocks are exactly this form (`loader/gguf_int4.py`).

The kernel is fast with bfloat16 or float16 activations on AVX-512 only (measured on one row:
float32 activations 30x slower than bf16, and torch's AVX2 code 8-10x slower than a dense
matmul), so `int4_kernel_is_fast` gates its use and float32 activations enter it as bfloat16.
Its scales and zeros take the activations' dtype.

Eight-bit weights (GGUF Q8_0: w = d q) fit it exactly as two int4 halves side by side along the
input features, multiplied by the input twice over (`input_repeats`): with u = q + 128 split
into nibbles hi and lo, w = 16 d (hi - 8) + (d (lo - 8) + 8 d).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32  # input features per scale/zero: one GGUF block (or K-quant sub-block)
_ROW_MULTIPLE = 16  # the kernel packs output rows in tiles of 16
_INNER_K_TILES = 2  # the packing argument the CUDA layout needs; the CPU packing ignores it
# From this many rows a matmul runs dense, on the weight unpacked to the compute dtype for the
# call: the kernel's time grows with every row and a dense bf16 matmul's far less (3072 x 576,
# 2 threads, unpacking included: 52 against 24 ms at 2048 rows, even at 512), so long prefill
# chunks gain and decode steps keep the 4-bit kernel.
DENSE_MIN_ROWS = 1024


def int4_kernel_available() -> bool:
    """torch has the CPU int4 packing and matmul ops."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu"
    )


def int4_kernel_is_fast() -> bool:
    """The kernel runs its AVX-512 code on this CPU (elsewhere a dense bf16/float32 matmul on
    dequantized weights is faster)."""
    return int4_kernel_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@dataclass(frozen=True)
class Int4Weight:
    """`q` uint8 [N, K] (values 0..15) and float32 `scale`, `zero` [N, K / INT4_GROUP]:
    w = (q - 8) * scale + zero, per group of `INT4_GROUP` consecutive input features."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]."""
        n, k = self.shape
        q = self.q.view(n, k // INT4_GROUP, INT4_GROUP).float() - 8.0
        return (q * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).reshape(n, k)

    def pad_rows(self, multiple: int = 16) -> Int4Weight:
        """Zero rows appended up to a multiple of `multiple` (the kernel's row tile)."""
        extra = -self.shape[0] % multiple
        if not extra:
            return self
        return Int4Weight(*(F.pad(t, (0, 0, 0, extra)) for t in (self.q, self.scale, self.zero)))

    @staticmethod
    def stack_rows(parts: list[Int4Weight]) -> Int4Weight:
        """One weight of the parts' rows in order (the shards of a fused qkv or gate_up)."""
        if len(parts) == 1:
            return parts[0]
        return Int4Weight(*(torch.cat(t, dim=0) for t in zip(*_fields(parts), strict=True)))


def _fields(parts: list[Int4Weight]) -> list[tuple[torch.Tensor, ...]]:
    return [(p.q, p.scale, p.zero) for p in parts]


def can_pack(shape: tuple[int, int]) -> bool:
    n, k = shape
    return n % _ROW_MULTIPLE == 0 and k % INT4_GROUP == 0 and n > 0 and k > 0


def pack_int4(weight: Int4Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight uint8 [N, K / 2], scales and zeros [K / group, N, 2] in `dtype`) as the
    kernel takes them."""
    if not can_pack(weight.shape):
        raise ValueError(
            f"int4 packing needs output rows divisible by {_ROW_MULTIPLE} and input features "
            f"by {INT4_GROUP}; got {weight.shape}"
        )
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        weight.q.to(torch.int32).contiguous(), _INNER_K_TILES
    )
    scales_and_zeros = torch.stack([weight.scale.t(), weight.zero.t()], dim=-1)
    return packed, scales_and_zeros.to(dtype).contiguous()


# The CPU packing stores each block of B output rows as K x B/2 bytes: byte k·B/2 + j holds
# row j's value at input k in its low nibble and row j + B/2's in its high one. B is the
# kernel's vector width: 64 rows where torch runs AVX-512 code, 32 with AVX2, so it is found
# by packing a probe. (Blocks of fewer than B rows, at the tail, are laid out otherwise; such
# weights are not unpacked.)
_PACK_BLOCK_CANDIDATES = (64, 32, 16)


def _decode_blocks(packed: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    blocks = packed.reshape(n // block, k, block // 2)
    return torch.cat([blocks & 0x0F, blocks >> 4], dim=2).transpose(1, 2).reshape(n, k)


@functools.cache
def _pack_block_n() -> int | None:
    """The packing's row block on this CPU, or None if no known layout matches."""
    n = max(_PACK_BLOCK_CANDIDATES)
    q = torch.arange(n * INT4_GROUP, dtype=torch.int64).remainder(13).to(torch.uint8)
    q = q.view(n, INT4_GROUP)
    ones = torch.ones(n, 1)
    packed, _ = pack_int4(Int4Weight(q, ones, torch.zeros(n, 1)), torch.float32)
    for block in _PACK_BLOCK_CANDIDATES:
        if torch.equal(_decode_blocks(packed, n, INT4_GROUP, block), q):
            return block
    return None


def unpack_int4(packed: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor | None:
    """The float32 weight [N, K] that `pack_int4` packed (w = (q - 8) * scale + zero, with the
    scales and zeros as the kernel holds them), or None when N is not a multiple of the
    packing's row block (or that layout is unknown)."""
    groups, n, _ = scales_and_zeros.shape
    k = groups * INT4_GROUP
    block = _pack_block_n()
    if block is None or n % block:
        return None
    q = _decode_blocks(packed, n, k, block)
    scale, zero = scales_and_zeros.float().permute(1, 0, 2).unbind(-1)  # [N, groups] each
    return Int4Weight(q, scale, zero).dequantize()


def compute_dtype_for(model_dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype inside the kernel: float16 for a float16 model, else bfloat16."""
    return torch.float16 if model_dtype == torch.float16 else torch.bfloat16


class Int4CpuLinearMethod:
    """A linear layer's `quant_method` with its weight int4-packed: the float weight parameter
    is dropped and the layer holds buffers `weight_int4` and `weight_scales_zeros`. With
    `input_repeats` 2 the weight is an 8-bit one as two int4 halves [N, 2 K]."""

    def __init__(
        self,
        layer: nn.Module,
        weight: Int4Weight,
        compute_dtype: torch.dtype,
        input_repeats: int = 1,
    ):
        self.out_features, packed_in = weight.shape
        self.in_features = packed_in // input_repeats
        old = getattr(layer, "weight", None)
        if old is not None and tuple(old.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"int4 weight {weight.shape} does not fit the layer's weight {tuple(old.shape)}"
            )
        packed, scales_and_zeros = pack_int4(weight, compute_dtype)
        if "weight" in layer._parameters:
            del layer._parameters["weight"]
        layer.register_buffer("weight_int4", packed)
        layer.register_buffer("weight_scales_zeros", scales_and_zeros)
        self.compute_dtype = compute_dtype
        self.input_repeats = input_repeats

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != self.compute_dtype:  # (a no-op call still costs a few µs, 120 a step)
            rows = rows.to(self.compute_dtype)
        y = self._dense(layer, rows) if rows.shape[0] >= DENSE_MIN_ROWS else None
        if y is None:
            rows = rows.repeat(1, self.input_repeats) if self.input_repeats > 1 else rows
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.contiguous(), layer.weight_int4, INT4_GROUP, layer.weight_scales_zeros
            )
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def _dense(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor | None:
        """The product through the weight unpacked for this call and rounded once to the
        compute dtype (the kernel keeps it float32: the two differ by that rounding), or None
        where the packing cannot be unpacked."""
        w = unpack_int4(layer.weight_int4, layer.weight_scales_zeros)
        if w is None:
            return None
        if self.input_repeats > 1:  # [x, x] · [W1, W2]ᵀ = x · (W1 + W2)ᵀ
            w = w.view(w.shape[0], self.input_repeats, self.in_features).sum(dim=1)
        return F.linear(rows, w.to(self.compute_dtype))


def int8_as_int4_pair(q: torch.Tensor, scale: torch.Tensor) -> Int4Weight:
    """Weights `scale * q` (q int8 [N, K], one scale per group [N, K / INT4_GROUP]) as two int4
    halves [N, 2 K], for `Int4CpuLinearMethod(..., input_repeats=2)`: exact."""
    u = q.view(torch.uint8) ^ 0x80  # q + 128 in 0..255
    return Int4Weight(
        torch.cat([u >> 4, u & 0x0F], dim=1),
        torch.cat([16 * scale, scale], dim=1),
        torch.cat([torch.zeros_like(scale), 8 * scale], dim=1),
    )


class Int4LMHead(nn.Module):
    """An LM head with an int4 weight (see `Int4CpuLinearMethod`). When it is tied to the
    embedding it keeps that dense weight too (as `weight`, shared as before), and more rows
    than `INT4_MAX_ROWS` take it: the int4 kernel's cost grows with every 4 rows, a dense
    matmul's hardly (measured: a 49152 x 576 head, one thread, is 2x faster in int4 at one
    row and 2x slower at 16)."""

    INT4_MAX_ROWS = 4

    def __init__(
        self,
        vocab_size: int,
        weight: Int4Weight,
        compute_dtype: torch.dtype,
        input_repeats: int = 1,
        tied: nn.Parameter | None = None,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.method = Int4CpuLinearMethod(self, weight, compute_dtype, input_repeats)
        self.weight = tied

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and hidden.shape[0] > self.INT4_MAX_ROWS:
            logits = F.linear(hidden, self.weight)
        else:
            logits = self.method.apply(self, hidden, None)
        return logits[..., : self.vocab_size]
