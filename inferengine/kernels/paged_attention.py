"""Paged attention over the block-table KV cache for mixed decode/prefill batches, with its torch
reference.

Hot path and CUDA-graph safe: launch shapes depend only on tensor shapes and the Python ints the
caller passes. Add nothing here that reads device values on the host.
"""

import math
from dataclasses import dataclass

import torch

from inferengine.kernels.kv_quant import dequantize, is_fp8
from inferengine.kernels.triton_utils import (
    arrival_counters,
    device_sms,
    hopper_or_later,
    next_power_of_2,
    pdl_launch,
    tma_ready,
)

LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class TileConfig:
    block_m: int  # rows per program: query tokens x the query heads of one KV head
    block_n: int  # keys per step of the inner loop
    num_warps: int
    num_stages: int
    # Query heads per tile on the prefill path (a divisor of the GQA group); 0: the whole group
    heads_per_tile: int = 0


# Fixed configs keyed by the padded head dim: autotuning is slow and does not mix with graphs.
# Decode's block_m is a floor; the split path widens it to fit q_len x group rows. Head dims
# pad to a power of two of at least 16 (tl.dot's smallest K); 8 -> 16, 80/96/112 -> 128,
# 192 -> 256. Past 256 the kernels are not built (`supports_head_dim`): the backend selector
# takes the torch reference at start-up instead.
PREFILL_CONFIGS = {
    16: TileConfig(128, 64, 4, 3),
    32: TileConfig(128, 64, 4, 3),
    64: TileConfig(128, 64, 4, 3),
    # One query head per tile, 64 x 64, 3 stages: best at chunk 2k, batch 1 and 4, with the
    # chunk's keys read from the fresh K/V by TMA (20261122T105448Z-kernels-attention-sweep,
    # 20261122T115129Z-prefill-dense-experiment).
    128: TileConfig(64, 64, 4, 3, heads_per_tile=1),
    256: TileConfig(64, 32, 8, 2),
}
DECODE_CONFIGS = {
    16: TileConfig(16, 64, 4, 3),
    32: TileConfig(16, 64, 4, 3),
    64: TileConfig(16, 64, 4, 3),
    128: TileConfig(16, 64, 4, 3),
    256: TileConfig(16, 32, 4, 2),
}
# Sequences with q_len * group <= this many rows take the split-KV path (decode, speculative
# verification); longer ones take the prefill path.
SPLIT_PATH_MAX_ROWS = 64
# Split-KV sizing: aim for this many programs per SM, never cut a context finer than this.
SPLIT_PROGRAMS_PER_SM = 4
SPLIT_MIN_TOKENS = 256
MAX_SPLITS = 128


def padded_head_dim(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def supports_head_dim(head_dim: int) -> bool:
    """Whether the Triton kernels have tile configs for this head dim."""
    return padded_head_dim(head_dim) in PREFILL_CONFIGS


def num_kv_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """How many programs share one sequence's context on the split-KV path."""
    programs = num_seqs * num_kv_heads
    wanted = math.ceil(SPLIT_PROGRAMS_PER_SM * sms / max(programs, 1))
    by_length = max(1, max_seq_len // SPLIT_MIN_TOKENS)
    return max(1, min(wanted, by_length, MAX_SPLITS))


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    min_query_len: int = 0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    decode_config: TileConfig | None = None,
    prefill_config: TileConfig | None = None,
    fused_merge: bool = True,
    fresh_key: torch.Tensor | None = None,
    fresh_value: torch.Tensor | None = None,
    fresh_tma: bool | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of `q` [T, Hq, D] (B sequences laid end to end) over the paged cache
    `kv_cache` [2, num_blocks, block_size, Hkv, D]. The queries of sequence i are its last
    q_len_i positions of seq_lens[i]. max_query_len and max_seq_len may be upper bounds,
    min_query_len a lower bound (it lets a prefill-only batch skip the decode launch).
    `soft_cap`: scores become soft_cap · tanh(scale · q·k / soft_cap) before mask and softmax.
    `num_splits` and the tile configs override the launch choices (tests, benchmark sweeps);
    `fused_merge=False` merges split-KV partials in a kernel of its own.

    `fresh_key`/`fresh_value` [T, Hkv, D]: this step's keys and values as they were written to
    the cache (views into the fused QKV output, or a tensor of its own such as normed keys;
    each may have its own strides). With them, prefill tiles read the chunk's own keys from
    these rows (TMA loads on Hopper, `fresh_tma` overrides) and only the context before the
    chunk through the block table.

    An fp8 `kv_cache` holds K / k_scale and V / v_scale (`kv_quant`): tiles are converted to
    q's dtype as loaded, k_scale folds into the score scale and v_scale into the output. Every
    key then comes from the pages (fresh K/V are ignored), so a prefix hit and a fresh prompt
    see the same quantized keys."""
    from inferengine.kernels.attention_kernels import merge_splits_kernel, paged_attention_kernel

    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = query_start_loc.shape[0] - 1
    group = num_q_heads // num_kv_heads
    assert num_q_heads == group * num_kv_heads, "query heads must be a multiple of KV heads"
    quant = is_fp8(kv_cache.dtype)
    assert quant or kv_cache.dtype == q.dtype, "the KV cache must be fp8 or have the query dtype"
    if quant:
        scale *= k_scale
        fresh_key = fresh_value = None
    assert q.stride(2) == 1 and kv_cache.stride(4) == 1 and block_table.stride(1) == 1
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    head_dim_pad = padded_head_dim(head_dim)
    decode_cfg = decode_config or DECODE_CONFIGS[head_dim_pad]
    prefill_cfg = prefill_config or PREFILL_CONFIGS[head_dim_pad]
    split_max_q = max_query_len if max_query_len * group <= SPLIT_PATH_MAX_ROWS else 1
    split_block_m = max(decode_cfg.block_m, next_power_of_2(split_max_q * group))
    splits = num_splits or num_kv_splits(num_seqs, num_kv_heads, max_seq_len, device_sms(q))

    pdl = pdl_launch(q)
    common = dict(
        **pdl,
        q_ptr=q,
        kv_cache_ptr=kv_cache,
        out_ptr=out,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        block_table_ptr=block_table,
        num_seqs=num_seqs,
        # With a soft cap the kernel takes tanh(q·k · scale / cap) and scales that by cap.
        qk_scale=(soft_cap if soft_cap else scale) * LOG2E,
        softcap_scale=scale / soft_cap if soft_cap else 1.0,
        v_scale=v_scale if quant else 1.0,
        sliding_window=sliding_window or 0,
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_cache_kv=kv_cache.stride(0),
        stride_kb=kv_cache.stride(1),
        stride_kt=kv_cache.stride(2),
        stride_kh=kv_cache.stride(3),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_bt=block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        USE_WINDOW=sliding_window is not None,
        SOFTCAP=bool(soft_cap),
        KV_QUANT=quant,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )

    # Sequences of at most split_max_q queries take the split-KV launch; none in a batch known
    # to hold only longer ones.
    decode_launch = min_query_len <= split_max_q
    if not decode_launch:
        splits = 1
    counters = None
    if splits > 1:
        rows = num_seqs * split_max_q * num_q_heads * splits
        part_out = torch.empty((rows, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((rows,), dtype=torch.float32, device=q.device)
        if fused_merge:
            counters = arrival_counters(q.device, num_seqs * num_kv_heads)
    else:
        part_out = part_lse = out  # unused
    if decode_launch:
        paged_attention_kernel[(num_kv_heads, num_seqs, splits)](
            **common,
            part_out_ptr=part_out,
            part_lse_ptr=part_lse,
            counter_ptr=counters if counters is not None else out,
            fresh_k=out,
            fresh_v=out,
            stride_fkt=0,
            stride_fkh=0,
            stride_fvt=0,
            stride_fvh=0,
            FRESH=0,
            num_splits=splits,
            min_q_len=0,
            HEADS_PER_TILE=group,
            BLOCK_M=split_block_m,
            BLOCK_Q=split_max_q,
            BLOCK_N=decode_cfg.block_n,
            SEQ_PER_PROGRAM=True,
            SPLIT_OUTPUT=splits > 1,
            FUSED_MERGE=counters is not None,
            MERGE_CHUNK=max(1, 64 // split_block_m),
            num_warps=decode_cfg.num_warps,
            num_stages=decode_cfg.num_stages,
        )
        if splits > 1 and counters is None:
            merge_splits_kernel[(num_seqs * split_max_q, num_q_heads)](
                out,
                part_out,
                part_lse,
                query_start_loc,
                splits,
                out.stride(0),
                out.stride(1),
                MAX_Q=split_max_q,
                SPLIT_CHUNK=16,
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                num_warps=4,
                **pdl,
            )

    if max_query_len > split_max_q:
        heads_per_tile = prefill_cfg.heads_per_tile or group
        assert group % heads_per_tile == 0, "heads_per_tile must divide the GQA group"
        block_m = max(prefill_cfg.block_m, next_power_of_2(heads_per_tile))
        block_q = block_m // heads_per_tile
        grid = (num_q_heads // heads_per_tile, num_tokens // block_q + num_seqs, 1)
        fresh = _fresh_kv_args(
            q, fresh_key, fresh_value, sliding_window, prefill_cfg.block_n, head_dim_pad, fresh_tma
        )
        paged_attention_kernel[grid](
            **common,
            **fresh,
            part_out_ptr=out,
            part_lse_ptr=out,
            counter_ptr=out,
            num_splits=1,
            min_q_len=split_max_q,
            HEADS_PER_TILE=heads_per_tile,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            BLOCK_N=prefill_cfg.block_n,
            SEQ_PER_PROGRAM=False,
            SPLIT_OUTPUT=False,
            FUSED_MERGE=False,
            MERGE_CHUNK=1,
            num_warps=prefill_cfg.num_warps,
            num_stages=prefill_cfg.num_stages,
        )
    return out


def _fresh_kv_args(
    q: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    sliding_window: int | None,
    block_n: int,
    head_dim_pad: int,
    want_tma: bool | None,
) -> dict:
    """Kernel arguments for reading the chunk's own keys from `key`/`value`: TMA descriptors
    over [T, Hkv*D] row views where Hopper and the layout allow, else pointers; FRESH=0 (all
    keys through the block table) without them or with a sliding window."""
    if key is None or value is None or sliding_window is not None:
        unused = dict(stride_fkt=0, stride_fkh=0, stride_fvt=0, stride_fvh=0)
        return dict(fresh_k=q, fresh_v=q, FRESH=0, **unused)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and key.dtype == value.dtype == q.dtype
    assert key.shape[0] == q.shape[0] and key.stride(2) == 1 and value.stride(2) == 1
    tma = (
        hopper_or_later(q)
        and q.dtype in (torch.bfloat16, torch.float16)
        and head_dim == head_dim_pad
        and key.stride(1) == head_dim
        and value.stride(1) == head_dim
    )
    if tma:
        k2d = key.as_strided((num_tokens, num_kv_heads * head_dim), (key.stride(0), 1))
        v2d = value.as_strided((num_tokens, num_kv_heads * head_dim), (value.stride(0), 1))
        tma = tma_ready(k2d, block_n, head_dim) and tma_ready(v2d, block_n, head_dim)
    if want_tma is not None:
        tma = tma and want_tma
    strides = dict(
        stride_fkt=key.stride(0),
        stride_fkh=key.stride(1),
        stride_fvt=value.stride(0),
        stride_fvh=value.stride(1),
    )
    if not tma:
        return dict(fresh_k=key, fresh_v=value, FRESH=1, **strides)
    from triton.tools.tensor_descriptor import TensorDescriptor

    return dict(
        fresh_k=TensorDescriptor.from_tensor(k2d, [block_n, head_dim]),
        fresh_v=TensorDescriptor.from_tensor(v2d, [block_n, head_dim]),
        FRESH=2,
        **strides,
    )


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Torch reference of `paged_attention`: gather each sequence's pages (an fp8 cache's
    dequantized), causal softmax in float32 (scores soft-capped first with `soft_cap`). Syncs
    with the host; for tests and the CPU path."""
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_begin, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        k, v = dequantize(k, k_scale, torch.float32), dequantize(v, v_scale, torch.float32)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_begin:q_end].float(), k) * scale
        if soft_cap:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= k_pos > q_pos - sliding_window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
