"""Triton kernels for the model's hot path besides attention: KV-cache store, RMSNorm (with
residual add), rotary embedding and SiLU-and-mul. Their wrappers and torch references live in
kv_store.py, norm.py, rotary.py and activation.py."""

import triton
import triton.language as tl

from inferengine.kernels.pdl_kernels import pdl_enter


@triton.jit
def store_kv_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_kv,
    stride_cb,
    stride_ct,
    stride_ch,
    k_scale,
    v_scale,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (tokens, head groups): copy HEADS_PER_PROGRAM heads of one token's K and V
    (QUANT: into an fp8 cache, see `_quantize`)."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
    token64 = token.to(tl.int64)
    key = tl.load(
        key_ptr + token64 * stride_kt + heads[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token64 * stride_vt + heads[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    cache_off = (
        (slot // BLOCK_SIZE) * stride_cb
        + (slot % BLOCK_SIZE) * stride_ct
        + heads[:, None] * stride_ch
        + offs_d[None, :]
    )
    dtype = kv_cache_ptr.dtype.element_ty
    key = _quantize(key, k_scale, dtype, QUANT, FP8_MAX)
    value = _quantize(value, v_scale, dtype, QUANT, FP8_MAX)
    tl.store(kv_cache_ptr + cache_off, key, mask=mask)
    tl.store(kv_cache_ptr + stride_cache_kv + cache_off, value, mask=mask)


@triton.jit
def _quantize(x, scale, dtype, QUANT: tl.constexpr, FP8_MAX: tl.constexpr):
    """`x` as the cache stores it: clamp(x / scale, ±FP8_MAX) in fp8 with QUANT, else cast."""
    if QUANT:
        x = tl.minimum(tl.maximum(x.to(tl.float32) / scale, -FP8_MAX), FP8_MAX)
    return x.to(dtype)


@triton.jit
def rms_norm_row(
    x_ptr, residual_ptr, weight_ptr, hidden_size, eps, stride_x, stride_r,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """This program's row (program id 0) of weight * rmsnorm(x (+ residual)) in float32, not yet
    rounded, with the row index, offsets and mask; with ADD_RESIDUAL the sum is stored back into
    the residual. HF order of rounding: (x + residual) rounds to the input dtype, the normalized
    row rounds to the input dtype, then the weight multiplies it."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / hidden_size
    normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0)
    return normed.to(tl.float32) * weight.to(tl.float32), row, offs, mask


@triton.jit
def rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    hidden_size,
    eps,
    stride_x,
    stride_r,
    stride_o,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row per program: `rms_norm_row`, stored in the output's dtype."""
    pdl_enter(USE_PDL)
    out, row, offs, mask = rms_norm_row(
        x_ptr, residual_ptr, weight_ptr, hidden_size, eps, stride_x, stride_r, ADD_RESIDUAL, BLOCK
    )
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def head_rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    num_heads,
    head_dim,
    eps,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (tokens, head blocks): `rms_norm_kernel`'s math on each head of a token (q/k norm),
    BLOCK_H heads per program, reading a strided [tokens, heads, head_dim] view in place."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (offs[None, :] < head_dim)
    x_offs = token * stride_xt + heads[:, None] * stride_xh + offs[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 1) / head_dim
    normed = (xf * (1.0 / tl.sqrt(variance + eps))[:, None]).to(x.dtype)
    weight = tl.load(weight_ptr + offs, mask=offs < head_dim, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)[None, :]
    out_offs = token * stride_ot + heads[:, None] * stride_oh + offs[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    x_ptr,
    num_heads,
    stride_h,
    cos,
    sin,
    offs_i,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads[:, None] < num_heads) & (offs_i[None, :] < HALF)
    if IS_NEOX:
        ptr1 = x_ptr + heads[:, None] * stride_h + offs_i[None, :]
        ptr2 = ptr1 + HALF
    else:
        ptr1 = x_ptr + heads[:, None] * stride_h + 2 * offs_i[None, :]
        ptr2 = ptr1 + 1
    r1, r2 = _rotate(
        tl.load(ptr1, mask=mask, other=0.0), tl.load(ptr2, mask=mask, other=0.0), cos, sin
    )
    tl.store(ptr1, r1, mask=mask)
    tl.store(ptr2, r2, mask=mask)


@triton.jit
def _rotate(x1, x2, cos, sin):
    """The rotated pair (x1 cos - x2 sin, x2 cos + x1 sin) in fp32, rounded to x's dtype."""
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    return (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)


@triton.jit
def rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    num_q_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos_sin,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token per program: all its query heads, then all its key heads."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_i = tl.arange(0, HALF_PAD)
    cs_ptr = cos_sin_ptr + pos * stride_cos_sin + offs_i
    cos = tl.load(cs_ptr, mask=offs_i < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + HALF, mask=offs_i < HALF, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr + token * stride_qt, num_q_heads, stride_qh, cos, sin, offs_i,
        HALF, Q_HEADS_PAD, IS_NEOX,
    )  # fmt: skip
    _rotate_heads(
        k_ptr + token * stride_kt, num_kv_heads, stride_kh, cos, sin, offs_i,
        HALF, K_HEADS_PAD, IS_NEOX,
    )  # fmt: skip


@triton.jit
def rotary_store_kv_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    cos_sin_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    num_q_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cos_sin,
    stride_cache_kv,
    stride_cb,
    stride_ct,
    stride_ch,
    k_scale,
    v_scale,
    QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One token per program: rotate its query heads in place (NeoX halves, the whole head),
    then its key heads in place, and write those and its value heads into the cache slot.
    A padded token (slot -1) only has its query rotated."""
    pdl_enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_i = tl.arange(0, HALF)
    cs_ptr = cos_sin_ptr + pos * stride_cos_sin + offs_i
    cos = tl.load(cs_ptr).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + HALF).to(tl.float32)[None, :]
    _rotate_heads(
        q_ptr + token * stride_qt, num_q_heads, stride_qh, cos, sin, offs_i,
        HALF, Q_HEADS_PAD, True,
    )  # fmt: skip
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:
        heads = tl.arange(0, K_HEADS_PAD)
        mask = heads[:, None] < num_kv_heads
        k_ptrs = k_ptr + token * stride_kt + heads[:, None] * stride_kh + offs_i[None, :]
        r1, r2 = _rotate(
            tl.load(k_ptrs, mask=mask, other=0.0), tl.load(k_ptrs + HALF, mask=mask, other=0.0),
            cos, sin,
        )  # fmt: skip
        v_ptrs = v_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_i[None, :]
        v1 = tl.load(v_ptrs, mask=mask, other=0.0)
        v2 = tl.load(v_ptrs + HALF, mask=mask, other=0.0)
        dtype = kv_cache_ptr.dtype.element_ty
        cache_ptrs = (
            kv_cache_ptr
            + (slot // BLOCK_SIZE) * stride_cb
            + (slot % BLOCK_SIZE) * stride_ct
            + heads[:, None] * stride_ch
            + offs_i[None, :]
        )
        # Rounded to the key's dtype first, as the unfused rotary kernel does.
        tl.store(k_ptrs, r1, mask=mask)
        tl.store(k_ptrs + HALF, r2, mask=mask)
        tl.store(cache_ptrs, _quantize(r1, k_scale, dtype, QUANT, FP8_MAX), mask=mask)
        tl.store(cache_ptrs + HALF, _quantize(r2, k_scale, dtype, QUANT, FP8_MAX), mask=mask)
        v1 = _quantize(v1, v_scale, dtype, QUANT, FP8_MAX)
        v2 = _quantize(v2, v_scale, dtype, QUANT, FP8_MAX)
        tl.store(cache_ptrs + stride_cache_kv, v1, mask=mask)
        tl.store(cache_ptrs + stride_cache_kv + HALF, v2, mask=mask)


@triton.jit
def silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    intermediate_size,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (rows, column blocks). silu rounds to the input dtype before the product, as
    HF's `act_fn(gate_proj(x)) * up_proj(x)` does."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < intermediate_size
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + intermediate_size + offs, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)
