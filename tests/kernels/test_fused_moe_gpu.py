"""Mixture-of-experts kernels at real model shapes on a GPU, in bf16, against the float32 torch
reference on the same (bf16) weights and inputs; and the kernels inside a CUDA graph."""

import pytest
import torch

from inferengine.kernels.fused_moe import fused_moe, fused_moe_ref, route, select_experts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# name -> (hidden, experts, top_k, expert intermediate size)
SHAPES = {
    "qwen3-30b-a3b": (2048, 128, 8, 768),
    "mixtral-8x7b": (4096, 8, 2, 14336),
}
# Tolerance. The reference is float32 throughout on the bf16 inputs; the kernel accumulates in
# float32 too but rounds twice to bf16 (relative error <= 2^-9 = 0.2% each): silu(gate)·up
# before the down projection, and each choice's weighted row before the top-k sum (then the sum
# once more). The first rounding reaches the output as a random-signed sum over the
# intermediate dimension, so it stays near 2^-9 of the output's scale, not 2^-9 per term. Three
# roundings of ~0.2% give rtol 1e-2 with margin; atol covers outputs near zero, whose error is
# set by the scale of the summands (~2^-9 of values of size ~1 here, x ~ N(0, 1) and weights
# scaled by fan-in), with 4x margin: 1e-2.
TOL = {"atol": 1e-2, "rtol": 1e-2}


def make(shape: str, num_tokens: int, seed: int = 0):
    hidden, num_experts, top_k, inter = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf16 = "cuda", torch.bfloat16

    def randn(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=gen, device=dev) * scale).to(bf16)

    w13 = randn(num_experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(num_experts, hidden, inter, scale=inter**-0.5)
    x = randn(num_tokens, hidden)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=dev)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_tokens", [1, 16, 256, 4096])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_moe_real_shapes(shape, num_tokens):
    x, w13, w2, weights, ids = make(shape, num_tokens)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    expected = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, **TOL)


def test_fused_moe_in_a_cuda_graph():
    """Captured once, replayed on new routing and inputs: no launch reads a device value."""
    x, w13, w2, weights, ids = make("qwen3-30b-a3b", 8)
    static = [x.clone(), weights.clone(), ids.clone()]
    fused_moe(static[0], w13, w2, static[1], static[2])  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(static[0], w13, w2, static[1], static[2])
    for seed in (1, 2):
        x, _, _, weights, ids = make("qwen3-30b-a3b", 8, seed=seed)
        for buffer, value in zip(static, (x, weights, ids), strict=True):
            buffer.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        expected = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        torch.testing.assert_close(out.float(), expected, **TOL)


@pytest.mark.parametrize("num_tokens", [1, 64, 8192])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_route_real_shapes(shape, num_tokens):
    """The one-launch router against torch's softmax and topk on float32 router logits."""
    _, num_experts, top_k, _ = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
    for renormalize in (True, False):
        want_w, want_ids = select_experts(logits, top_k, renormalize)
        w, ids = route(logits, top_k, renormalize)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-5)
