"""Mixture-of-experts compute: routing, the Triton grouped-GEMM path and its torch reference.

The Triton path sorts (token, choice) rows by expert, padded per expert to the GEMM's tile
height (`moe_align`); one grouped GEMM computes silu(x W_gate) · (x W_up) for every row; a
second multiplies by W_down and the routing weight; the top-k rows of a token are summed last,
in a fixed order (no atomics: the same inputs give the same bits) by one more kernel. `route`
does the router's softmax and top-k in one launch. Hot path and CUDA-graph
safe: buffer sizes and grids come from tensor shapes, never from device values. Add nothing
here that syncs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inferengine.kernels.triton_utils import next_power_of_2

_ALIGN_BLOCK_T = 1024  # rows per program of the count and scatter kernels


@dataclass(frozen=True, slots=True)
class MoeConfig:
    block_m: int  # rows of one tile; every tile holds rows of one expert
    block_n: int
    block_k: int
    group_m: int = 1  # tiles along M that walk N together (L2 reuse of the A rows)
    num_warps: int = 4
    num_stages: int = 3


def choose_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    """Small tiles when experts see few rows each (decode: the GEMM streams weights), large
    ones for prefill-sized batches; float32 takes smaller tiles to fit shared memory. From an
    H100 sweep at the Qwen3-30B-A3B and Mixtral shapes, 1 to 8192 tokens: up to 64 rows per
    expert the tile choice moved the time by at most 5% (at 16+ rows per expert 32-row tiles
    were 40% faster than 16-row ones for Mixtral); past 64, 128×128 tiles with 8 warps were
    the best tried (8 to 24% faster than 64×128 at 2048 and 8192 tokens)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if dtype == torch.float32:
        return MoeConfig(16, 64, 64, 1, 4, 3) if rows_per_expert <= 16 else MoeConfig(64, 64, 32, 8)
    if rows_per_expert <= 16:
        return MoeConfig(16, 64, 128, 1, 4, 4)
    if rows_per_expert <= 64:
        return MoeConfig(32, 64, 64, 8, 4, 4)
    return MoeConfig(128, 128, 64, 8, 8, 3)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, the top k, optionally renormalised to sum to one
    (Mixtral: always, which is a softmax over the top-k logits; Qwen3-MoE: `norm_topk_prob`).
    Returns float32 weights [T, k] and int64 expert ids [T, k]."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts` in one Triton launch (softmax, top-k and renormalisation per token):
    float32 weights [T, k] and int64 ids [T, k], descending like torch.topk's."""
    from inferengine.kernels.fused_moe_kernels import moe_route_kernel

    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    block_e = max(16, next_power_of_2(num_experts))
    moe_route_kernel[(num_tokens,)](
        logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        TOP_K=top_k,
        TOP_K_PAD=max(2, next_power_of_2(top_k)),
        RENORMALIZE=renormalize,
        BLOCK_E=block_e,
        num_warps=1 if block_e <= 256 else 4,
    )
    return weights, ids


def max_padded_rows(numel: int, num_experts: int, block_m: int) -> int:
    """The most rows the alignment can produce: each expert that has rows pads < block_m."""
    return numel + min(num_experts, numel) * (block_m - 1)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flat ids (token · k + choice) grouped by expert, experts in id order, each expert's run
    padded with `numel` to a multiple of `block_m`; the expert of each `block_m` tile (-1 past
    the end); the padded row count as a one-element device tensor. Entries past that count
    are unspecified, and so is the order of rows within a run (`moe_align_sorted`: ascending).
    Four launches (a memset, count, layout, scatter), whatever the size."""
    from inferengine.kernels.fused_moe_kernels import (
        moe_count_kernel,
        moe_layout_kernel,
        moe_scatter_kernel,
    )

    flat = topk_ids.reshape(-1)
    numel, device = flat.numel(), flat.device
    max_blocks = -(-max_padded_rows(numel, num_experts, block_m) // block_m)
    counts = torch.zeros(2 * num_experts, dtype=torch.int32, device=device)
    counts, cursors = counts[:num_experts], counts[num_experts:]
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    chunks = (-(-numel // _ALIGN_BLOCK_T),)
    moe_count_kernel[chunks](flat, counts, numel, BLOCK_T=_ALIGN_BLOCK_T)
    block_e = max(16, next_power_of_2(num_experts))
    moe_layout_kernel[(1,)](
        counts,
        cursors,
        sorted_ids,
        block_experts,
        num_padded,
        num_experts,
        numel,
        max_blocks,
        BLOCK_M=block_m,
        BLOCK_E=block_e,
        BLOCK_B=max(16, 4096 // block_e),
        num_warps=4,
    )
    moe_scatter_kernel[chunks](flat, cursors, sorted_ids, numel, BLOCK_T=_ALIGN_BLOCK_T)
    return sorted_ids, block_experts, num_padded


def moe_align_sorted(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` from torch ops (a stable sort by expert; rows ascending within a run),
    without host syncs: the reference of the alignment kernels."""
    flat = topk_ids.reshape(-1).long()
    numel, device = flat.numel(), flat.device
    max_blocks = -(-max_padded_rows(numel, num_experts, block_m) // block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    first_of_expert = counts.cumsum(0) - counts
    dest = (ends - padded)[experts] + torch.arange(numel, device=device) - first_of_expert[experts]
    sorted_ids = torch.full((max_blocks * block_m,), numel, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    first_rows = torch.arange(max_blocks, device=device) * block_m
    block_experts = torch.searchsorted(ends, first_rows, right=True)
    block_experts = torch.where(first_rows < ends[-1], block_experts, -1).to(torch.int32)
    return sorted_ids, block_experts, ends[-1:].to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor | None,
    numel: int,
    top_k: int,
    gated: bool,
    config: MoeConfig,
) -> None:
    from inferengine.kernels.fused_moe_kernels import moe_gemm_kernel

    sorted_ids, block_experts, num_padded = aligned
    n = out.shape[1]
    num_pid_m = block_experts.shape[0]
    grid = (num_pid_m * -(-n // config.block_n),)
    moe_gemm_kernel[grid](
        a,
        w,
        out,
        sorted_ids,
        block_experts,
        num_padded,
        topk_weights if topk_weights is not None else out,
        numel,
        n,
        a.shape[1],
        num_pid_m,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        TOP_K=top_k,
        GATED=gated,
        MUL_WEIGHT=topk_weights is not None,
        # float32 models get float32 products (no TF32), like the torch path.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        GROUP_M=config.group_m,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Σ_j topk_weights[t, j] · W2[e] (silu(x W1[e]ᵀ) · x W3[e]ᵀ) with e = topk_ids[t, j].

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [T, k]. Returns
    [T, H] in x's dtype (the per-choice rows rounded to it once, their sum rounded once more).
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    numel = num_tokens * top_k
    if numel == 0:
        return torch.zeros_like(x)
    config = config or choose_config(num_tokens, top_k, num_experts, x.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    aligned = moe_align(topk_ids, num_experts, config.block_m)
    inter = torch.empty(numel, two_i // 2, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, inter, aligned, None, numel, top_k, True, config)
    out = torch.empty(numel, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1)
    weights = weights if weights.is_contiguous() else weights.contiguous()
    _grouped_gemm(inter, w2, out, aligned, weights, numel, 1, False, config)
    if top_k == 1:
        return out
    return sum_choices(out, num_tokens, top_k)


_SUM_BLOCK = 1024


def sum_choices(rows: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """[T · k, H] -> [T, H]: each token's k rows summed in float32, rounded once."""
    from inferengine.kernels.fused_moe_kernels import moe_sum_kernel

    hidden = rows.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=rows.dtype, device=rows.device)
    block = min(_SUM_BLOCK, next_power_of_2(hidden))
    moe_sum_kernel[(num_tokens, -(-hidden // block))](
        rows, out, hidden, out.stride(0), TOP_K=top_k, BLOCK=block, num_warps=4
    )
    return out


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Torch reference of `fused_moe`, the same arithmetic as Transformers' experts: for each
    expert with tokens, in id order, gate/up, silu · up, down, times the weight (promoted to
    the weight's dtype), rounded to x's dtype and added into the token's row."""
    out = torch.zeros_like(x)
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # a host sync: CPU path
    weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        tokens = rows // top_k
        gate, up = F.linear(x.index_select(0, tokens), w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        y = y * weights.index_select(0, rows)[:, None]
        out.index_add_(0, tokens, y.to(x.dtype))
    return out
