"""Triton kernels of batched LoRA (shrink x Aᵀ, expand · Bᵀ) with one adapter slot per token; wrappers in lora.py.

One program per (token, tile of rank or output features): it reads its token's slot and that
slot's A or B rows, so tokens of any mix of adapters share a launch; a token of slot −1 reads
nothing and writes nothing (expand) or zeros (shrink). Products are fp32 sums of broadcasts, not
`tl.dot`: correct at any size, tuned on a GPU later (vLLM's punica kernels sort tokens by
adapter so that tiles of one adapter use the tensor cores).
"""

import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, out_ptr, K, R,
    stride_xt, stride_as, stride_ar, stride_ot,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[t, r] = sum_k x[t, k] A[slot[t], r, k] (0 where slot[t] is −1)."""
    t = tl.program_id(0)
    block_r = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    k_end = tl.where(slot >= 0, K, 0)  # a token without an adapter reads nothing
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_r = block_r * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_k = offs_k < k_end
        x = tl.load(x_ptr + t * stride_xt + offs_k, mask=in_k, other=0.0).to(tl.float32)
        a_ptrs = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :]
        a = tl.load(a_ptrs, mask=(offs_r[:, None] < R) & in_k[None, :], other=0.0)
        acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    out = out_ptr + t * stride_ot + offs_r
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=offs_r < R)


@triton.jit
def lora_expand_kernel(
    s_ptr, b_ptr, slots_ptr, scales_ptr, y_ptr, N, R, offset,
    stride_st, stride_bs, stride_bn, stride_yt,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """y[t, offset + n] += scale[slot[t]] sum_r s[t, r] B[slot[t], n, r] (nothing where
    slot[t] is −1)."""
    t = tl.program_id(0)
    block_n = tl.program_id(1)
    slot = tl.load(slots_ptr + t)
    n_end = tl.where(slot >= 0, N, 0)  # a token without an adapter reads and writes nothing
    r_end = tl.where(slot >= 0, R, 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = offs_n < n_end
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        in_r = offs_r < r_end
        s = tl.load(s_ptr + t * stride_st + offs_r, mask=in_r, other=0.0).to(tl.float32)
        b_ptrs = b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :]
        b = tl.load(b_ptrs, mask=in_n[:, None] & in_r[None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * s[None, :], axis=1)
    scale = tl.load(scales_ptr + slot).to(tl.float32)
    y_ptrs = y_ptr + t * stride_yt + offset + offs_n
    y = tl.load(y_ptrs, mask=in_n, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + scale * acc).to(y_ptr.dtype.element_ty), mask=in_n)
