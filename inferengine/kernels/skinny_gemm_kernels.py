"""Triton kernels of the skinny GEMM y = x @ Wᵀ (+ bias) for decode-sized M; the wrapper, config
table and torch reference live in skinny_gemm.py. W may be FP8 with one scale per output row
(W8A16): its tiles are converted to x's dtype in registers and the scale applied once per row."""

import triton
import triton.language as tl

from inferengine.kernels.pdl_kernels import pdl_enter

# How a program streams W and multiplies (METHOD; skinny_gemm.METHODS holds the same numbers):
DOT = tl.constexpr(0)  # pointer loads (cp.async pipeline), tensor cores with M padded to 16
TMA = tl.constexpr(1)  # TMA descriptor loads (out of bounds reads as zero), tensor cores
FMA = tl.constexpr(2)  # pointer loads, fp32 multiply-adds on the CUDA cores
# How split-K partial sums become the output (REDUCE; skinny_gemm.REDUCE_MODES):
NO_SPLIT = tl.constexpr(0)  # one K-split: the program stores its own output
PARTIALS = tl.constexpr(1)  # each split stores fp32 partials; skinny_reduce_kernel sums them
SERIAL = tl.constexpr(2)  # as PARTIALS, but the last split of a tile to finish sums them
ATOMIC = tl.constexpr(3)  # fp32 atomic adds into a zeroed buffer; skinny_reduce_kernel casts


@triton.jit
def _store_output(out_ptr, bias_ptr, acc, offs_n, offs_m, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, M_PAD] fp32 (+ bias) -> out[m, n] in the output dtype."""
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc += bias.to(tl.float32)[:, None]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dot_steps(
    w_ptr, x_ptr, w_rows, offs_m, k_start, k_end, M, K, stride_wn, stride_xm,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):  # fmt: skip
    """Tensor cores: acc [BLOCK_N, M_PAD] += W tile [BLOCK_N, BLOCK_K] @ x tileᵀ per step.
    x rows past M are masked (not read), so padding M=1 to 16 costs no extra traffic."""
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), BLOCK_K)
    w_ptrs = w_ptr + w_rows[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    in_m = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=in_m, other=0.0)
        else:
            in_k = (k + offs_k)[None, :] < K
            w = tl.load(w_ptrs, mask=in_k, other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=in_m & in_k, other=0.0)
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _fma_w(w_ptrs, k, offs_k, K, EVEN_K: tl.constexpr):
    """The W tile [BLOCK_N, 1, BLOCK_K] at K offset k (where w_ptrs point)."""
    if EVEN_K:
        return tl.load(w_ptrs, eviction_policy="evict_first")
    in_k = (k + offs_k)[None, None, :] < K
    return tl.load(w_ptrs, mask=in_k, other=0.0, eviction_policy="evict_first")


@triton.jit
def _fma_x(x_ptrs, k, offs_k, in_m, K, EVEN_K: tl.constexpr):
    """The x tile at K offset k as [1, M_PAD, BLOCK_K], fp32 (where x_ptrs point)."""
    if EVEN_K:
        x = tl.load(x_ptrs, mask=in_m, other=0.0)
    else:
        x = tl.load(x_ptrs, mask=in_m & ((k + offs_k)[None, :] < K), other=0.0)
    return x[None, :, :].to(tl.float32)


@triton.jit
def _fma_steps(
    w_ptr, x_ptr, w_rows, offs_m, k_start, k_end, M, K, stride_wn, stride_xm,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    VEC_K: tl.constexpr, W_AHEAD: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """fp32 multiply-adds into a [BLOCK_N, M_PAD, BLOCK_K] accumulator (no reduction inside
    the loop), summed over K at the end. W loads as [BLOCK_N, 1, BLOCK_K] and x as
    [M_PAD, BLOCK_K]: the compiler then keeps W in its coalesced load layout (each thread holds
    all M_PAD columns of its W elements) and rearranges only the small x tile. Costs M_PAD
    accumulator registers per W element held: for M <= 4 or so. W is read VEC_K elements at
    a time.

    With W_AHEAD the first W tile is read before waiting on the previous kernel (PDL): W is a
    weight, not that kernel's output, so its first bytes stream in while that kernel drains,
    or while a short kernel before this one (a norm) still runs; x is read after the wait."""
    offs_k = tl.max_contiguous(tl.multiple_of(tl.arange(0, BLOCK_K), BLOCK_K), VEC_K)
    w_ptrs = w_ptr + w_rows[:, None, None] * stride_wn + (k_start + offs_k)[None, None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    in_m = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_N, M_PAD, BLOCK_K), dtype=tl.float32)
    k_loop = k_start
    if W_AHEAD:
        w = _fma_w(w_ptrs, k_start, offs_k, K, EVEN_K)
        pdl_enter(USE_PDL)
        acc += w.to(tl.float32) * _fma_x(x_ptrs, k_start, offs_k, in_m, K, EVEN_K)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_loop += BLOCK_K
    for k in range(k_loop, k_end, BLOCK_K):
        w = _fma_w(w_ptrs, k, offs_k, K, EVEN_K)
        acc += w.to(tl.float32) * _fma_x(x_ptrs, k, offs_k, in_m, K, EVEN_K)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return tl.sum(acc, axis=2)


@triton.jit
def _tma_steps(
    w_desc, x_desc, k_start, k_end, pid_n,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """As _dot_steps with TMA loads; the descriptors zero-fill rows past N and M and K past K."""
    acc = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        w = w_desc.load([pid_n * BLOCK_N, k])
        x = x_desc.load([0, k])
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    return acc


@triton.jit
def skinny_gemm_kernel(
    x_in,
    w_in,
    scale_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    METHOD: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    REDUCE: tl.constexpr,
    VEC_K: tl.constexpr,
    W_AHEAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (N tiles, K splits). Streams W[BLOCK_N rows, one K-split] once, multiplies by all of x.

    x_in and w_in are pointers, or TMA descriptors when METHOD == TMA. The accumulator is
    transposed, [BLOCK_N, M_PAD]: the weight tile is the MMA's wide operand. Pointer loads
    clamp weight rows past N onto row N-1 (no N mask); those rows are never stored. Split-K
    partials are always summed in split order, so results do not depend on timing, except
    with ATOMIC. With HAS_SCALE, W is FP8 and row n of the product is scaled by scale[n].
    """
    if METHOD != FMA or W_AHEAD == 0:
        pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if METHOD == DOT:
        acc = _dot_steps(
            w_in, x_in, w_rows, offs_m, k_start, k_end, M, K, stride_wn, stride_xm,
            M_PAD, BLOCK_N, BLOCK_K, EVEN_K,
        )  # fmt: skip
    elif METHOD == TMA:
        acc = _tma_steps(w_in, x_in, k_start, k_end, pid_n, M_PAD, BLOCK_N, BLOCK_K)
    else:
        acc = _fma_steps(
            w_in, x_in, w_rows, offs_m, k_start, k_end, M, K, stride_wn, stride_xm,
            M_PAD, BLOCK_N, BLOCK_K, EVEN_K, VEC_K, W_AHEAD, USE_PDL,
        )  # fmt: skip
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + w_rows)[:, None]

    if REDUCE == NO_SPLIT:
        _store_output(out_ptr, bias_ptr, acc, offs_n, offs_m, M, N, stride_om, HAS_BIAS)
    else:
        # fp32 partials laid out [split, M, N]
        mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
        part_offs = offs_m[None, :] * N + offs_n[:, None]
        if REDUCE == ATOMIC:
            tl.atomic_add(partial_ptr + part_offs, acc, mask=mask, sem="relaxed")
        else:
            tl.store(partial_ptr + pid_k * M * N + part_offs, acc, mask=mask)
        if REDUCE == SERIAL:
            # All threads' stores precede the release; the last arrival acquires them all.
            tl.debug_barrier()
            arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel")
            if arrived == tl.num_programs(1) - 1:
                total = tl.zeros((BLOCK_N, M_PAD), dtype=tl.float32)
                for s in range(0, tl.num_programs(1)):
                    total += tl.load(
                        partial_ptr + s * M * N + part_offs,
                        mask=mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                _store_output(out_ptr, bias_ptr, total, offs_n, offs_m, M, N, stride_om, HAS_BIAS)
                tl.atomic_xchg(counter_ptr + pid_n, 0)  # ready for the next launch


@triton.jit
def skinny_reduce_kernel(
    partial_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    num_splits,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (N blocks, M): out[m] = sum of the partials[s, m] in split order (+ bias), cast."""
    pdl_enter(USE_PDL)
    m = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, num_splits):
        total += tl.load(partial_ptr + (s * M + m) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
