"""Int4/int8 weight-only GEMM (W4A16, W8A16): the layout the kernels read and its torch
references (`*_ref`), which the Triton kernels (and their skinny decode variant) will be
tested against.

The layout every format is repacked into once its checkpoint is in
(`model/quantization/int_weights.py`), GPTQ's own:
- `qweight` int32 [K / (32 / bits), N]: input rows packed along K, value i of a word in bits
  [i * bits, (i + 1) * bits) (the order GPTQ and compressed-tensors use; AWQ's interleaved
  column order is undone at load);
- `scales` [G, N] and `zeros` [G, N] in the activation dtype (the zero points as numbers,
  so GPTQ v1's stored zero - 1, possibly 16, fits), w[k, n] = (q[k, n] - zeros[g, n]) *
  scales[g, n] with g = g_idx[k], or k // group_size without `g_idx`.

To come with the GPU kernels: a tiled W4A16/W8A16 Triton GEMM over this layout, a skinny
variant for decode-sized M (as `skinny_gemm.py` for 16-bit weights), and for act-order the
rows sorted by group at repack (x's columns permuted per call) so a K tile meets one group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# AWQ's GEMM packing puts output column ORDER[i] of each 8 in bits [4i, 4i + 4) of a word.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

# Output columns dequantized at a time by the reference: bounds its float copy of the weight.
_REF_ELEMENTS = 1 << 24


def pack_factor(bits: int) -> int:
    return 32 // bits


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The unsigned `bits`-bit values of int32 words, spread along `dim` (uint8: 8x the words'
    count along it). `order`: the column each word's value i goes to (AWQ_PACK_ORDER), else i."""
    per = pack_factor(bits)
    if bits in (4, 8):  # bytes of little-endian words, never wider than 8 bits a value
        as_bytes = packed.contiguous().view(torch.uint8).unflatten(-1, (-1, 4))
        if bits == 4:  # low nibble first
            as_bytes = torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).flatten(-2)
        values = as_bytes  # [..., words, per]
    else:
        shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
        values = ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)
    if order is not None:
        values = values[..., torch.argsort(torch.tensor(order, device=packed.device))]
    moved = values.movedim(-1, dim + 1)
    shape = list(packed.shape)
    shape[dim] *= per
    return moved.reshape(shape)


def repack_columns(
    unpack: Callable[[slice], torch.Tensor], columns: int, rows: int, bits: int
) -> torch.Tensor:
    """The kernels' `qweight` [rows / pack, columns] from `unpack(block)`, the uint8 values
    [rows, block] of a block of output columns, a block at a time: a repack at load holds a
    few times one block, not a layer's unpacked values."""
    out = torch.empty(rows // pack_factor(bits), columns, dtype=torch.int32)
    step = max(1, _REF_ELEMENTS // max(1, rows))
    for start in range(0, columns, step):
        block = slice(start, min(columns, start + step))
        out[:, block] = pack_int32(unpack(block), bits, dim=0)
    return out


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """`unpack_int32`'s inverse in the sequential order: values [.., n, ..] along `dim`
    (n a multiple of 32 / bits) into int32 words."""
    per = pack_factor(bits)
    shape = list(values.shape)
    if shape[dim] % per:
        raise ValueError(f"{shape[dim]} values along dim {dim} do not fill {bits}-bit words")
    grouped = values.to(torch.int32).unflatten(dim, (shape[dim] // per, per))
    shifts = torch.arange(per, device=values.device, dtype=torch.int32) * bits
    view = [1] * grouped.dim()
    view[dim + 1] = per
    words = grouped << shifts.view(view)
    # Disjoint bits: the sum is the bitwise or (int32 wraps where bit 31 is set).
    return words.sum(dim=dim + 1, dtype=torch.int32)


@dataclass
class IntWeights:
    """One layer's weights in the kernels' layout (module docstring)."""

    qweight: torch.Tensor  # int32 [K / pack, N]
    scales: torch.Tensor  # [G, N]
    zeros: torch.Tensor  # [G, N]
    g_idx: torch.Tensor | None  # int32 [K], or None: k // group_size
    bits: int
    group_size: int  # -1: one group

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * pack_factor(self.bits)

    def groups_of_rows(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx.long()
        rows = torch.arange(self.in_features, device=self.qweight.device)
        return torch.zeros_like(rows) if self.group_size == -1 else rows // self.group_size


def dequantize_ref(w: IntWeights, columns: slice | None = None) -> torch.Tensor:
    """W [K, N] (or its `columns`) in the scales' dtype: (q - zero) * scale per group."""
    columns = columns or slice(None)
    q = unpack_int32(w.qweight[:, columns], w.bits, dim=0)
    groups = w.groups_of_rows()
    scales, zeros = w.scales[:, columns], w.zeros[:, columns]
    return (q.to(scales.dtype) - zeros[groups]) * scales[groups]


def int_linear_ref(x: torch.Tensor, w: IntWeights, bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ + b with W dequantized (`dequantize_ref`) a block of output columns at a time, in
    x's dtype: the reference the W4A16/W8A16 kernels must match."""
    n = w.qweight.shape[1]
    step = max(1, _REF_ELEMENTS // max(1, w.in_features))
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    for start in range(0, n, step):
        block = slice(start, min(n, start + step))
        out[:, block] = x2 @ dequantize_ref(w, block).to(x.dtype)
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], n)
