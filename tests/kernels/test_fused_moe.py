"""Mixture-of-experts kernels against the torch reference: the alignment's layout, and the
grouped GEMMs with fresh random inputs at small sizes (interpreter or GPU), including skewed
routing, experts with no tokens and top-k 1, 2 and 8."""

import pytest
import torch

from inferengine.kernels.fused_moe import (
    MoeConfig,
    fused_moe,
    fused_moe_ref,
    max_padded_rows,
    moe_align,
    moe_align_sorted,
    route,
    select_experts,
    sum_choices,
)


def routing(gen, num_tokens: int, num_experts: int, top_k: int, hot: int | None = None):
    """Softmax top-k routing of random logits; with `hot`, only experts [0, hot) get tokens
    (the rest have no rows at all)."""
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if hot is not None:
        logits[:, hot:] = -1e4
    return select_experts(logits, top_k, renormalize=True)


def weights(gen, num_experts: int, hidden: int, inter: int, dtype=torch.float32):
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5
    return w13.to(dtype), w2.to(dtype)


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,block_m,hot",
    [
        (1, 8, 2, 16, None),
        (7, 4, 1, 16, None),
        (33, 8, 4, 16, None),  # several tiles per expert
        (20, 16, 8, 32, None),
        (50, 8, 2, 16, 1),  # every row on expert 0 (the rest empty)
        (9, 128, 8, 16, None),  # most of 128 experts empty
        (700, 4, 2, 64, None),  # more rows than one count/scatter program takes
    ],
)
@pytest.mark.parametrize("align", [moe_align, moe_align_sorted])
def test_align_layout(gen, device, align, num_tokens, num_experts, top_k, block_m, hot):
    _, ids = routing(gen, num_tokens, num_experts, top_k, hot)
    ids = ids.to(device)
    sorted_ids, block_experts, num_padded = align(ids, num_experts, block_m)
    flat = ids.reshape(-1).cpu()
    numel = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(padded.sum())
    assert int(num_padded) == total <= max_padded_rows(numel, num_experts, block_m)
    rows = sorted_ids[:total].cpu().long()
    expected_experts = torch.repeat_interleave(torch.arange(num_experts), padded // block_m)
    assert block_experts[: total // block_m].cpu().tolist() == expected_experts.tolist()
    assert (block_experts[total // block_m :] == -1).all()
    start = 0
    for expert in range(num_experts):
        run = rows[start : start + int(padded[expert])]
        n = int(counts[expert])
        # This expert's rows (ascending from the sort, in any order from the kernels), then
        # padding.
        rows_of_expert = torch.nonzero(flat == expert).flatten()
        if align is moe_align_sorted:
            assert run[:n].tolist() == rows_of_expert.tolist()
        assert run[:n].sort().values.tolist() == rows_of_expert.tolist()
        assert (run[n:] == numel).all()
        start += int(padded[expert])


CASES = [
    # tokens, experts, top_k, hidden, intermediate, config (None: the automatic choice), hot
    (1, 8, 2, 64, 32, None, None),
    (5, 4, 1, 64, 48, None, None),
    (16, 8, 8, 32, 32, None, None),  # top-8 of 8: every expert gets every token
    (24, 16, 8, 64, 32, MoeConfig(16, 32, 32, group_m=2), None),
    (40, 8, 2, 80, 48, MoeConfig(32, 32, 32, group_m=4), 3),  # N, K not tile multiples; skew
    (37, 4, 2, 64, 32, MoeConfig(64, 32, 32, group_m=8), None),  # GROUP_M past the tiles
    (12, 32, 4, 48, 40, MoeConfig(16, 16, 16), None),  # most experts empty, odd sizes
    (0, 4, 2, 32, 32, None, None),  # an empty step
]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,hidden,inter,config,hot", CASES)
def test_fused_moe_matches_reference_float32(
    gen, device, num_tokens, num_experts, top_k, hidden, inter, config, hot
):
    w, ids = routing(gen, num_tokens, num_experts, top_k, hot)
    w13, w2 = weights(gen, num_experts, hidden, inter)
    x = torch.randn(num_tokens, hidden, generator=gen)
    expected = fused_moe_ref(x, w13, w2, w, ids)
    args = [t.to(device) for t in (x, w13, w2, w, ids)]
    out = fused_moe(*args, config=config)
    assert out.shape == x.shape and out.dtype == x.dtype
    # float32 products ("ieee" dots) summed in another order than the reference's.
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=1e-4)


def test_fused_moe_bfloat16_within_rounding(gen, device):
    """bf16 inputs: the kernel rounds silu(gate)·up and each choice's row to bf16 (relative
    error 2^-9 each) where the float32 reference of the same inputs rounds nothing."""
    w, ids = routing(gen, 20, 8, 2)
    w13, w2 = weights(gen, 8, 64, 32, torch.bfloat16)
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    expected = fused_moe_ref(x.float(), w13.float(), w2.float(), w, ids)
    out = fused_moe(*[t.to(device) for t in (x, w13, w2, w, ids)])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), expected, atol=2e-2, rtol=2e-2)


def test_select_experts_renormalises_as_asked(gen):
    logits = torch.randn(6, 8, generator=gen)
    w, ids = select_experts(logits, 3, renormalize=True)
    top = torch.topk(logits, 3, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(w, torch.softmax(top.values, dim=-1))  # Mixtral's definition
    raw, _ = select_experts(logits, 3, renormalize=False)
    torch.testing.assert_close(raw, torch.softmax(logits, -1).gather(1, ids))


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,renormalize",
    [(1, 8, 2, True), (13, 8, 2, False), (9, 128, 8, True), (7, 60, 4, False), (0, 8, 2, True),
     (5, 300, 3, True)],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_select_experts(
    gen, device, num_tokens, num_experts, top_k, renormalize, dtype
):
    """The one-launch router: the same experts in the same (descending) order as torch.topk,
    weights within float32 rounding of the torch softmax."""
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(dtype)
    want_w, want_ids = select_experts(logits, top_k, renormalize)
    w, ids = route(logits.to(device), top_k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, atol=1e-6, rtol=1e-5)


def test_route_of_a_strided_view(gen, device):
    wide = torch.randn(6, 40, generator=gen)
    logits = wide[:, 4:20]  # row stride 40
    want_w, want_ids = select_experts(logits, 4, True)
    w, ids = route(logits.to(device), 4, True)
    assert torch.equal(ids.cpu(), want_ids)
    torch.testing.assert_close(w.cpu(), want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k,hidden", [(3, 2, 64), (5, 8, 2100), (1, 4, 7)])
def test_sum_choices_rounds_once(gen, device, dtype, num_tokens, top_k, hidden):
    rows = torch.randn(num_tokens * top_k, hidden, generator=gen).to(dtype)
    out = sum_choices(rows.to(device), num_tokens, top_k)
    acc = torch.zeros(num_tokens, hidden)
    for j in range(top_k):  # float32, in choice order, then one rounding
        acc += rows.view(num_tokens, top_k, hidden)[:, j].float()
    torch.testing.assert_close(out.cpu(), acc.to(dtype), atol=0, rtol=0)


def test_route_keeps_ids_in_range_on_nan_rows(device):
    """Garbage (padding) rows with NaN logits (one NaN makes the whole softmax NaN) still
    route to valid, distinct experts, as torch.topk does; finite rows beside them are
    unaffected."""
    logits = torch.tensor([[float("nan")] * 8, [0.0, 1.0, 2.0, 3.0, float("nan"), 0.5, 0.2, 0.1]])
    logits = torch.cat([logits, torch.randn(3, 8)])
    w, ids = route(logits.to(device), 2, True)
    ids = ids.cpu()
    assert ((ids >= 0) & (ids < 8)).all()
    assert all(len(set(row)) == 2 for row in ids.tolist())
    want_w, want_ids = select_experts(logits[2:], 2, True)
    assert torch.equal(ids[2:], want_ids)
    torch.testing.assert_close(w.cpu()[2:], want_w, atol=1e-6, rtol=1e-5)
