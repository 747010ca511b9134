"""Triton kernel of the dynamic per-token FP8 activation quantization; the wrapper and torch
reference live in fp8_gemm.py."""

import triton
import triton.language as tl

from inferengine.kernels.pdl_kernels import pdl_enter


@triton.jit
def per_token_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    K,
    stride_xm,
    stride_qm,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (M,): scale[m] = max(amax(|x[m]|) / FP8_MAX, MIN_SCALE); q[m] = x[m] / scale[m],
    saturated to ±FP8_MAX. Two passes over the row; the second reads it from L2."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k + offs, mask=k + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for k in range(0, K, BLOCK):
        mask = k + offs < K
        x = tl.load(x_ptr + row * stride_xm + k + offs, mask=mask, other=0.0)
        q = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_qm + k + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
