"""Triton kernels of the mixture-of-experts layer: token/expert alignment and the grouped GEMM.
Their wrapper, launch configs and torch reference live in fused_moe.py.

Rows are (token, choice) pairs, numbered `token * top_k + choice` ("flat ids"). The alignment
(count, layout, scatter) groups flat ids by expert and pads each expert's run to a multiple of
BLOCK_M with the id `numel` (no row), so every BLOCK_M tile belongs to one expert.

Sizes that follow the step's token count (`numel`, `max_blocks`, `num_pid_m`) are not
specialised on: Triton would otherwise compile a variant per divisibility class of each, the
first time a step of that class ran, stalling the engine mid-serving for seconds.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["numel"])
def moe_count_kernel(topk_ids_ptr, counts_ptr, numel, BLOCK_T: tl.constexpr):
    """Grid (row chunks): rows per expert, added atomically into zeroed `counts`."""
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = offs < numel
    ids = tl.load(topk_ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    tl.atomic_add(counts_ptr + ids, 1, mask=mask, sem="relaxed")


@triton.jit(do_not_specialize=["numel", "max_blocks"])
def moe_layout_kernel(
    counts_ptr,
    cursors_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    num_experts,
    numel,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program: each expert's run [start, start + padded count) in expert order; writes
    the run starts (the scatter's cursors), the padding ids (`numel`) at each run's tail, the
    expert of every BLOCK_M tile (-1 past the end) and the padded total."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    tl.store(cursors_ptr + experts, starts, mask=experts < num_experts)
    pad = tl.arange(0, BLOCK_M)
    pad_pos = (starts + counts)[:, None] + pad[None, :]
    pad_mask = pad[None, :] < (padded - counts)[:, None]
    tl.store(sorted_ids_ptr + pad_pos, numel + tl.zeros_like(pad_pos), mask=pad_mask)
    # The expert of a tile: how many experts' runs end at or before its first row.
    for b0 in range(0, max_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first < total, expert, -1)
        tl.store(block_experts_ptr + blocks, expert, mask=blocks < max_blocks)


@triton.jit(do_not_specialize=["numel"])
def moe_scatter_kernel(topk_ids_ptr, cursors_ptr, sorted_ids_ptr, numel, BLOCK_T: tl.constexpr):
    """Grid (row chunks): each row takes its expert's next slot. The order of rows within an
    expert's run varies from call to call; no result depends on it (a tile's rows are
    independent, and a token's rows are summed by flat id)."""
    offs = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = offs < numel
    ids = tl.load(topk_ids_ptr + offs, mask=mask, other=0).to(tl.int32)
    pos = tl.atomic_add(cursors_ptr + ids, 1, mask=mask, sem="relaxed")
    tl.store(sorted_ids_ptr + pos, offs, mask=mask)


@triton.jit(do_not_specialize=["numel", "num_pid_m"])
def moe_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    block_experts_ptr,
    num_padded_ptr,
    topk_weights_ptr,
    numel,
    N,
    K,
    num_pid_m,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[flat id, n] = A[flat id // TOP_K] · W[expert, n] over one BLOCK_M tile of sorted rows.

    GATED: W holds gate rows [0, N) then up rows [N, 2N); the tile computes both and stores
    silu(gate) · up. MUL_WEIGHT: the result is scaled by the row's routing weight. Accumulation
    and the epilogue are float32; the store rounds once to out's dtype. The grid covers the most
    tiles the alignment can produce; tiles past its padded total return at once.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ids_ptr + offs_m)
    row_ok = rows < numel
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_rows = (rows // TOP_K).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = (
        w_ptr
        + expert.to(tl.int64) * stride_we
        + offs_n[None, :].to(tl.int64) * stride_wn
        + offs_k[:, None] * stride_wk
    )
    up_offset = N * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        weight = tl.load(topk_weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, out, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def moe_route_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One program per token: softmax over the experts in float32, the TOP_K largest in
    descending order (ties: the lower expert id), renormalised to sum to one if asked; writes
    float32 weights and int64 ids [tokens, TOP_K]. A NaN ranks above every number, as in
    torch.topk, so ids stay in range whatever the row holds (a padding row may be garbage)."""
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    x = tl.load(logits_ptr + row * stride_l + experts, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    e = tl.where(valid, tl.exp(x - tl.max(x, 0)), 0.0)
    probs = e / tl.sum(e, 0)
    key = tl.where(valid, tl.where(probs != probs, 2.0, probs), -1.0)
    slots = tl.arange(0, TOP_K_PAD)
    top_w = tl.zeros([TOP_K_PAD], dtype=tl.float32)
    top_i = tl.zeros([TOP_K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, 0)
        pick = tl.minimum(tl.min(tl.where(key == best, experts, BLOCK_E), 0), num_experts - 1)
        chosen = experts == pick
        top_w = tl.where(slots == j, tl.sum(tl.where(chosen, probs, 0.0), 0), top_w)
        top_i = tl.where(slots == j, pick.to(tl.int64), top_i)
        key = tl.where(chosen, -2.0, key)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, 0)
    tl.store(weights_ptr + row * TOP_K + slots, top_w, mask=slots < TOP_K)
    tl.store(ids_ptr + row * TOP_K + slots, top_i, mask=slots < TOP_K)


@triton.jit
def moe_sum_kernel(rows_ptr, out_ptr, hidden, stride_o, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (tokens, hidden blocks): out[t] = Σ_j rows[t · TOP_K + j], in float32 in the order
    j = 0 .. TOP_K-1, rounded once to out's dtype. Rows are contiguous [tokens · TOP_K, hidden]."""
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (token * TOP_K + j) * hidden + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + token * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
