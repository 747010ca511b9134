"""Batched LoRA for many adapters in one step: shrink (x Aᵀ) and expand (· Bᵀ, scaled), per-token slots.

Every token carries the slot of its request's adapter (−1: none). The references compute each
token's product against all slots in one matmul and keep its own slot's part (a gather for the
shrink, a one-hot scatter for the expand): no loop over tokens or adapters, no data-dependent
shapes, so a step with any mix of adapters is two matmuls per projection. The extra work is
`max_loras`-fold on the rank dimension, small next to the base GEMM at the ranks LoRA uses.
`lora_shrink` / `lora_expand` are the Triton pair (`lora_kernels.py`), checked against these
references in the interpreter; the worker runs the references until the pair is measured and
captured in CUDA graphs on a GPU.
"""

from __future__ import annotations

import torch


def lora_shrink_ref(
    x: torch.Tensor, a_stacked: torch.Tensor, token_slots: torch.Tensor
) -> torch.Tensor:
    """[T, R]: row t is x[t] A[s]ᵀ for s = token_slots[t], zeros where s is −1.

    x: [T, in]; a_stacked: [S, R, in] (rank padded to R with zero rows); token_slots: [T] int."""
    num_slots, rank, _ = a_stacked.shape
    every = (x @ a_stacked.reshape(num_slots * rank, -1).t()).view(-1, num_slots, rank)
    index = token_slots.clamp(min=0).view(-1, 1, 1).expand(-1, 1, rank)
    own = every.gather(1, index).squeeze(1)
    return own * (token_slots >= 0).unsqueeze(1).to(own.dtype)


def lora_expand_ref(
    y: torch.Tensor,
    shrunk: torch.Tensor,
    b_stacked: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
    offset: int = 0,
) -> torch.Tensor:
    """Add scales[s] · shrunk[t] B[s]ᵀ into y[t, offset : offset + out] for s = token_slots[t]
    (nothing where s is −1); returns y.

    y: [T, ≥ offset + out]; shrunk: [T, R]; b_stacked: [S, out, R]; scales: [S]."""
    num_slots, out_features, rank = b_stacked.shape
    valid = token_slots >= 0
    slots = token_slots.clamp(min=0)
    weighted = shrunk * (scales[slots] * valid.to(scales.dtype)).unsqueeze(1).to(shrunk.dtype)
    one_hot = shrunk.new_zeros(shrunk.shape[0], num_slots, rank)
    one_hot.scatter_(1, slots.view(-1, 1, 1).expand(-1, 1, rank), weighted.unsqueeze(1))
    delta = one_hot.view(-1, num_slots * rank) @ b_stacked.transpose(1, 2).reshape(-1, out_features)
    y[:, offset : offset + out_features] += delta.to(y.dtype)
    return y


def lora_ref_loop(
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    token_slots: torch.Tensor,
    scales: torch.Tensor,
) -> torch.Tensor:
    """The plain per-token definition, for tests: scales[s] · x[t] A[s]ᵀ B[s]ᵀ (0 where s is −1)."""
    out = x.new_zeros(x.shape[0], b_stacked.shape[1])
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            out[t] = scales[s] * (x[t] @ a_stacked[s].t() @ b_stacked[s].t())
    return out


def lora_shrink(
    x: torch.Tensor, a_stacked: torch.Tensor, token_slots: torch.Tensor, block_r: int = 16,
    block_k: int = 64,
) -> torch.Tensor:  # fmt: skip
    """`lora_shrink_ref` as a Triton kernel (one program per token and rank tile)."""
    from inferengine.kernels.lora_kernels import lora_shrink_kernel

    x, a_stacked = x.contiguous(), a_stacked.contiguous()
    tokens, (_, rank, in_features) = x.shape[0], a_stacked.shape
    out = torch.empty(tokens, rank, dtype=x.dtype, device=x.device)
    if tokens:
        grid = (tokens, -(-rank // block_r))
        lora_shrink_kernel[grid](
            x, a_stacked, token_slots, out, in_features, rank,
            x.stride(0), a_stacked.stride(0), a_stacked.stride(1), out.stride(0),
            BLOCK_R=block_r, BLOCK_K=block_k,
        )  # fmt: skip
    return out


def lora_expand(
    y: torch.Tensor, shrunk: torch.Tensor, b_stacked: torch.Tensor, token_slots: torch.Tensor,
    scales: torch.Tensor, offset: int = 0, block_n: int = 64, block_r: int = 16,
) -> torch.Tensor:  # fmt: skip
    """`lora_expand_ref` as a Triton kernel (one program per token and output tile); y's rows
    must be contiguous (stride 1 along features)."""
    from inferengine.kernels.lora_kernels import lora_expand_kernel

    assert y.stride(1) == 1, "y's features must be contiguous"
    shrunk, b_stacked = shrunk.contiguous(), b_stacked.contiguous()
    _, out_features, rank = b_stacked.shape
    if y.shape[0]:
        grid = (y.shape[0], -(-out_features // block_n))
        lora_expand_kernel[grid](
            shrunk, b_stacked, token_slots, scales, y, out_features, rank, offset,
            shrunk.stride(0), b_stacked.stride(0), b_stacked.stride(1), y.stride(0),
            BLOCK_N=block_n, BLOCK_R=block_r,
        )  # fmt: skip
    return y
