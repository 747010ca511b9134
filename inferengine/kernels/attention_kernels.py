"""Triton kernels behind `paged_attention`: a flash-attention tile loop over paged K/V, and the
merge of split-KV partial results.

Rows of a program's query tile are (query token, query head) pairs: `HEADS_PER_TILE` of the
`GROUP` query heads that share one KV head sit in the same tile (all of them for decode), so each
K/V tile is loaded once for all of them.
"""

import triton
import triton.language as tl

from inferengine.kernels.pdl_kernels import pdl_enter


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The sequence that owns query tile `pid`: tiles of sequence i start at
    query_start_loc[i] // BLOCK_Q + i (room for one partial tile per sequence), which grows
    with i, so binary-search it."""
    # Explicit tensors: Triton may specialize num_seqs == 1 into a constant.
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attend_kv_tile(
    acc,
    l_i,
    m_i,
    q,
    k_head_ptr,
    v_head_ptr,
    block_table_row_ptr,
    start_n,
    kv_end,
    q_pos,
    sliding_window,
    qk_scale,
    softcap_scale,
    stride_kb,
    stride_kt,
    offs_n,
    offs_d,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys start_n .. start_n + BLOCK_N - 1. Unmasked tiles lie
    wholly inside every row's visible range, so they skip all bounds and causal checks."""
    pos = start_n + offs_n
    if MASKED:
        in_range = pos < kv_end
        block_ids = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=in_range, other=0)
    else:
        block_ids = tl.load(block_table_row_ptr + pos // BLOCK_SIZE)
    token_off = block_ids.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt
    kv_off = token_off[:, None] + offs_d[None, :]
    if MASKED:
        kv_mask = in_range[:, None] & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_head_ptr + kv_off, mask=kv_mask, other=0.0)
    elif HEAD_DIM_PAD != HEAD_DIM:
        kv_mask = offs_d[None, :] < HEAD_DIM
        k = tl.load(k_head_ptr + kv_off, mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_head_ptr + kv_off)
    if MASKED or HEAD_DIM_PAD != HEAD_DIM:
        v = tl.load(v_head_ptr + kv_off, mask=kv_mask, other=0.0)
    else:
        v = tl.load(v_head_ptr + kv_off)
    # An fp8 cache's tiles become q's dtype (exactly); their scales are applied by the caller.
    return _softmax_step(
        acc, l_i, m_i, q, k.to(q.dtype), v.to(q.dtype), pos, q_pos, sliding_window, qk_scale,
        softcap_scale, MASKED, USE_WINDOW, DOT_PRECISION, SOFTCAP,
    )  # fmt: skip


@triton.jit
def _attend_fresh_tile(
    acc, l_i, m_i, q, fresh_k, fresh_v, q_start, start_j, q_len, context_len, q_pos, kv_head,
    stride_fkt, stride_fkh, stride_fvt, stride_fvh, qk_scale, softcap_scale, offs_n, offs_d,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MASKED: tl.constexpr, FRESH: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """As _attend_kv_tile for keys start_j .. start_j + BLOCK_N - 1 of this step's own tokens
    (positions context_len + j), read from the step's own K/V rows instead of the pages:
    rows q_start + j, by pointer (FRESH == 1) or TMA descriptor (FRESH == 2). A TMA tile runs
    past the sequence into other rows: the next sequence's, zeros past the tensor, or a CUDA
    graph's padding tokens, whose values are whatever their rows' (unwritten) attention output
    made them, NaN included. The causal mask gives those keys p = 0, but 0 · NaN is NaN in
    P @ V, so their values are zeroed."""
    j = start_j + offs_n
    if FRESH == 2:
        k = fresh_k.load([q_start + start_j, kv_head * HEAD_DIM])
        v = fresh_v.load([q_start + start_j, kv_head * HEAD_DIM])
        if MASKED:
            v = tl.where((j < q_len)[:, None], v, 0.0)
    else:
        row = (q_start + j).to(tl.int64)[:, None]
        k_off = row * stride_fkt + kv_head * stride_fkh + offs_d[None, :]
        v_off = row * stride_fvt + kv_head * stride_fvh + offs_d[None, :]
        if MASKED or HEAD_DIM_PAD != HEAD_DIM:
            mask = (j < q_len)[:, None] & (offs_d[None, :] < HEAD_DIM)
            k = tl.load(fresh_k + k_off, mask=mask, other=0.0)
            v = tl.load(fresh_v + v_off, mask=mask, other=0.0)
        else:
            k = tl.load(fresh_k + k_off)
            v = tl.load(fresh_v + v_off)
    return _softmax_step(
        acc, l_i, m_i, q, k, v, context_len + j, q_pos, 0, qk_scale, softcap_scale, MASKED, False,
        DOT_PRECISION, SOFTCAP,
    )  # fmt: skip


@triton.jit
def _tanh(x):
    """tanh from exp2 (Triton's interpreter has no tanh): 1 - 2 / (e^2x + 1), exact at ±inf."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def _softmax_step(
    acc, l_i, m_i, q, k, v, pos, q_pos, sliding_window, qk_scale, softcap_scale,
    MASKED: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online softmax over one key tile at positions `pos`; masked tiles apply causality (and
    the window) per row. The scale (> 0) is applied to the row maximum and inside one
    multiply-add per score, not as a pass of its own over the tile. SOFTCAP: scores become
    tanh(qk · softcap_scale) first (softcap_scale = scale / cap; qk_scale then holds
    cap · log2(e)), so cap · tanh(scale · qk / cap) is what the softmax sees."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:
        qk = _tanh(qk * softcap_scale)
    if MASKED:
        visible = pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        qk = tl.where(visible, qk, float("-inf"))
    # m_i starts finite (-1e30), so fully masked rows give p = 0 and alpha = 1, never NaN.
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Ints that change from step to step must not specialize the kernel (Triton would compile a new
# variant for values 1 and multiples of 16 in the middle of serving).
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "min_q_len", "sliding_window"])
def paged_attention_kernel(
    q_ptr,
    kv_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counter_ptr,
    fresh_k,
    fresh_v,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    num_seqs,
    num_splits,
    min_q_len,
    qk_scale,
    softcap_scale,
    v_scale,
    sliding_window,
    stride_qt,
    stride_qh,
    stride_cache_kv,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_fkt,
    stride_fkh,
    stride_fvt,
    stride_fvh,
    GROUP: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEQ_PER_PROGRAM: tl.constexpr,
    SPLIT_OUTPUT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    MERGE_CHUNK: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FRESH: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_QUANT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (query-head tiles, query tiles, splits). SEQ_PER_PROGRAM: tile i is sequence i
    whole (sequences with 1 <= q_len <= BLOCK_Q; the split-KV path). Otherwise tiles hold
    BLOCK_Q tokens of sequences with q_len > min_q_len (the prefill path), the last tile of a
    sequence first, so the longest rows start early. FUSED_MERGE: the last split of a
    (sequence, head tile) to finish merges the partials (counters start and end at zero).
    FRESH (prefill path, one split, no window): the keys of this step's tokens come from the
    fresh_k/fresh_v [T, Hkv, D] (each with its own row and head strides) instead of the
    pages (1: pointers, 2: TMA). KV_QUANT: the pages are fp8, V scaled by 1 / v_scale (K's
    scale is folded into qk_scale and softcap_scale)."""
    pdl_enter(USE_PDL)
    head_tile = tl.program_id(0)
    pid = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head_tile // (GROUP // HEADS_PER_TILE)
    num_q_heads = tl.num_programs(0) * HEADS_PER_TILE

    if SEQ_PER_PROGRAM:
        seq = pid
    else:
        seq = _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    q_len = q_end - q_start
    if SEQ_PER_PROGRAM:
        q_tile = 0
        if (q_len == 0) | (q_len > BLOCK_Q):
            return
    else:
        q_tile = q_end // BLOCK_Q + seq - pid
        # Tiles past the last sequence's own (a graph padded with tokens but no spare sequence
        # slot) land on it with q_tile < 0: they belong to no one.
        if (q_len <= min_q_len) | (q_tile * BLOCK_Q >= q_len) | (q_tile < 0):
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_tile * BLOCK_Q + offs_m // HEADS_PER_TILE
    q_head = head_tile * HEADS_PER_TILE + offs_m % HEADS_PER_TILE
    row_valid = (offs_m < BLOCK_Q * HEADS_PER_TILE) & (q_idx < q_len)
    q_pos = context_len + q_idx
    if HEAD_DIM_PAD == HEAD_DIM:
        row_mask = row_valid[:, None]
    else:
        row_mask = row_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    q_off = (q_start + q_idx)[:, None].to(tl.int64) * stride_qt + q_head[:, None] * stride_qh
    q = tl.load(q_ptr + q_off + offs_d[None, :], mask=row_mask, other=0.0)

    # Keys this tile needs: [kv_lo, kv_hi). Below `full_hi` every key is visible to every row;
    # with a window, so is everything from `full_lo` on. Phases: masked, unmasked, masked.
    first_pos = context_len + q_tile * BLOCK_Q
    last_pos = context_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_hi = last_pos + 1
    if USE_WINDOW:
        kv_lo = (tl.maximum(first_pos - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N
        window_lo = tl.maximum(last_pos - sliding_window + 1, 0)
        full_lo = kv_lo + tl.cdiv(window_lo - kv_lo, BLOCK_N) * BLOCK_N
    else:
        kv_lo = first_pos * 0
        full_lo = kv_lo
    full_hi = kv_lo + ((first_pos + 1 - kv_lo) // BLOCK_N) * BLOCK_N
    full_lo = tl.minimum(full_lo, full_hi)

    tiles_per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, BLOCK_N), num_splits)
    split_lo = kv_lo + split * tiles_per_split * BLOCK_N
    split_hi = tl.minimum(split_lo + tiles_per_split * BLOCK_N, kv_hi)

    k_head_ptr = kv_cache_ptr + kv_head * stride_kh
    v_head_ptr = k_head_ptr + stride_cache_kv
    block_table_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)

    if FRESH != 0:
        # Context keys, all visible to every row, from the pages; then the chunk's own keys.
        # Only tiles with context enter the pipelined loop (two stages: on the H100 faster than
        # the launch's three); the partial last tile, at most one, is not pipelined. Without
        # the branch the empty pipeline cost prompts with no context 5-10%; ctx_full computed
        # inside it made the loop 3-4% slower with context.
        ctx_full = (context_len // BLOCK_N) * BLOCK_N
        if context_len > 0:
            for start_n in tl.range(0, ctx_full, BLOCK_N, num_stages=2):
                acc, l_i, m_i = _attend_kv_tile(
                    acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_row_ptr, start_n,
                    context_len, q_pos, 0, qk_scale, softcap_scale, stride_kb, stride_kt, offs_n,
                    offs_d, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, False, False, DOT_PRECISION,
                    SOFTCAP,
                )  # fmt: skip
            # Positions past the context are the chunk's, not read here.
            ctx_last = tl.minimum(q_pos, context_len - 1)
            for start_n in tl.range(ctx_full, context_len, BLOCK_N, num_stages=1):
                acc, l_i, m_i = _attend_kv_tile(
                    acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_row_ptr, start_n,
                    context_len, ctx_last, 0, qk_scale, softcap_scale, stride_kb, stride_kt, offs_n,
                    offs_d, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, False, DOT_PRECISION,
                    SOFTCAP,
                )  # fmt: skip
        first_q = q_tile * BLOCK_Q
        last_q = tl.minimum(first_q + BLOCK_Q, q_len) - 1
        fresh_full = ((first_q + 1) // BLOCK_N) * BLOCK_N
        for start_j in range(0, fresh_full, BLOCK_N):
            acc, l_i, m_i = _attend_fresh_tile(
                acc, l_i, m_i, q, fresh_k, fresh_v, q_start, start_j, q_len, context_len, q_pos,
                kv_head, stride_fkt, stride_fkh, stride_fvt, stride_fvh, qk_scale, softcap_scale,
                offs_n, offs_d, HEAD_DIM, HEAD_DIM_PAD, False, FRESH, DOT_PRECISION, SOFTCAP,
            )  # fmt: skip
        for start_j in range(fresh_full, last_q + 1, BLOCK_N):
            acc, l_i, m_i = _attend_fresh_tile(
                acc, l_i, m_i, q, fresh_k, fresh_v, q_start, start_j, q_len, context_len, q_pos,
                kv_head, stride_fkt, stride_fkh, stride_fvt, stride_fvh, qk_scale, softcap_scale,
                offs_n, offs_d, HEAD_DIM, HEAD_DIM_PAD, True, FRESH, DOT_PRECISION, SOFTCAP,
            )  # fmt: skip
    else:
        if USE_WINDOW:
            for start_n in range(split_lo, tl.minimum(full_lo, split_hi), BLOCK_N):
                acc, l_i, m_i = _attend_kv_tile(
                    acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_row_ptr, start_n, kv_hi,
                    q_pos, sliding_window, qk_scale, softcap_scale, stride_kb, stride_kt, offs_n,
                    offs_d, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, USE_WINDOW, DOT_PRECISION,
                    SOFTCAP,
                )  # fmt: skip
        for start_n in range(tl.maximum(split_lo, full_lo), tl.minimum(full_hi, split_hi), BLOCK_N):
            acc, l_i, m_i = _attend_kv_tile(
                acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_row_ptr, start_n, kv_hi,
                q_pos, sliding_window, qk_scale, softcap_scale, stride_kb, stride_kt, offs_n,
                offs_d, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, False, USE_WINDOW, DOT_PRECISION,
                SOFTCAP,
            )  # fmt: skip
        for start_n in range(tl.maximum(split_lo, full_hi), split_hi, BLOCK_N):
            acc, l_i, m_i = _attend_kv_tile(
                acc, l_i, m_i, q, k_head_ptr, v_head_ptr, block_table_row_ptr, start_n, kv_hi,
                q_pos, sliding_window, qk_scale, softcap_scale, stride_kb, stride_kt, offs_n,
                offs_d, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, True, USE_WINDOW, DOT_PRECISION,
                SOFTCAP,
            )  # fmt: skip

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if KV_QUANT:
        out = out * v_scale
    if not SPLIT_OUTPUT:
        o_off = (q_start + q_idx)[:, None].to(tl.int64) * stride_ot + q_head[:, None] * stride_oh
        tl.store(out_ptr + o_off + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        # Partial rows are laid out [seq, BLOCK_Q, q_head, split] with HEAD_DIM floats each.
        row_id = (seq * BLOCK_Q + q_idx) * num_q_heads + q_head
        part_row = row_id.to(tl.int64) * num_splits + split
        has_keys = l_i > 0.0
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)
        part_ptrs = part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part_ptrs, out, mask=row_mask)
        if FUSED_MERGE:
            # All threads' stores precede the release; the last arrival acquires them all.
            tl.debug_barrier()
            counter = counter_ptr + seq * tl.num_programs(0) + head_tile
            arrived = tl.atomic_add(counter, 1, sem="acq_rel")
            if arrived == num_splits - 1:
                # No keys at all: tiles_per_split is 0 and no split is active.
                active_splits = tl.cdiv(
                    tl.cdiv(kv_hi - kv_lo, BLOCK_N), tl.maximum(tiles_per_split, 1)
                )
                _merge_rows(
                    out_ptr, part_out_ptr, part_lse_ptr, row_id, q_start + q_idx, q_head,
                    row_valid, offs_d, active_splits, num_splits, stride_ot, stride_oh,
                    HEAD_DIM, BLOCK_M, HEAD_DIM_PAD, MERGE_CHUNK,
                )  # fmt: skip
                tl.atomic_xchg(counter, 0)  # ready for the next launch


@triton.jit
def _merge_rows(
    out_ptr, part_out_ptr, part_lse_ptr, row_id, token, q_head, row_valid, offs_d,
    active_splits, num_splits, stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, MERGE_CHUNK: tl.constexpr,
):  # fmt: skip
    """Combine the partials of BLOCK_M rows from the first `active_splits` splits (the rest saw
    no keys), MERGE_CHUNK splits per load, each weighted by its base-2 log-sum-exp with a
    running maximum, as merge_splits_kernel does for one row."""
    base = row_id.to(tl.int64) * num_splits
    offs_c = tl.arange(0, MERGE_CHUNK)
    d_ok = offs_d < HEAD_DIM
    m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    denom = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for s0 in range(0, active_splits, MERGE_CHUNK):
        part_row = base[:, None] + (s0 + offs_c)[None, :]  # [BLOCK_M, MERGE_CHUNK]
        valid = row_valid[:, None] & ((s0 + offs_c) < active_splits)[None, :]
        lse = tl.load(
            part_lse_ptr + part_row, mask=valid, other=float("-inf"), cache_modifier=".cg"
        )
        m_new = tl.maximum(m, tl.max(lse, 1))
        rescale = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new[:, None])
        # A split whose keys were all masked has lse = -inf and a partial not to be read.
        part_mask = (valid & (lse > float("-inf")))[:, :, None] & d_ok[None, None, :]
        part_ptrs = part_out_ptr + part_row[:, :, None] * HEAD_DIM + offs_d[None, None, :]
        part = tl.load(part_ptrs, mask=part_mask, other=0.0, cache_modifier=".cg")
        acc = acc * rescale[:, None] + tl.sum(part * weight[:, :, None], 1)
        denom = denom * rescale + tl.sum(weight, 1)
        m = m_new
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]
    o_off = token[:, None].to(tl.int64) * stride_ot + q_head[:, None] * stride_oh
    o_mask = row_valid[:, None] & d_ok[None, :]
    tl.store(out_ptr + o_off + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["num_splits"])
def merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    MAX_Q: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Grid (num_seqs * MAX_Q, q heads): combine the partial outputs of one query row, each
    weighted by its base-2 log-sum-exp, SPLIT_CHUNK splits at a time with a running maximum."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    q_head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)
    seq = row // MAX_Q
    q_idx = row % MAX_Q
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (q_idx >= q_len) | (q_len > MAX_Q):
        return

    base = (row * num_q_heads + q_head).to(tl.int64) * num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.full([1], -1.0e30, dtype=tl.float32)
    denom = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    for s0 in range(0, num_splits, SPLIT_CHUNK):
        offs_c = s0 + tl.arange(0, SPLIT_CHUNK)
        lse = tl.load(part_lse_ptr + base + offs_c, mask=offs_c < num_splits, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, 0))
        rescale = tl.exp2(m - m_new)
        weight = tl.exp2(lse - m_new)
        # A split that saw no keys has lse = -inf and an unwritten-to-matter partial: skip it.
        part_mask = (lse > float("-inf"))[:, None] & (offs_d[None, :] < HEAD_DIM)
        part_ptrs = part_out_ptr + (base + offs_c)[:, None] * HEAD_DIM + offs_d[None, :]
        part = tl.load(part_ptrs, mask=part_mask, other=0.0)
        acc = acc * rescale + tl.sum(part * weight[:, None], 0)
        denom = denom * rescale + tl.sum(weight, 0)
        m = m_new

    out = acc / tl.where(denom > 0.0, denom, 1.0)
    o_ptrs = out_ptr + (q_start + q_idx).to(tl.int64) * stride_ot + q_head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
