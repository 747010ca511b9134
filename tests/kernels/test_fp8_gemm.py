"""FP8 linear: quantization round trips, the W8A16 skinny kernel and the per-token quantization
kernel against their torch references (small shapes in the interpreter, or on a GPU), and the
`torch._scaled_mm` path at real shapes on a GPU."""

import pytest
import torch

from inferengine.kernels import fp8_gemm as fg
from inferengine.kernels.skinny_gemm import SkinnyConfig, skinny_linear, skinny_linear_ref

# e4m3 keeps 3 mantissa bits: rounding to nearest is off by at most 2^-4 of the value (normal
# range); values below the smallest normal (2^-6 · scale) are off by at most half a subnormal
# step (2^-10 · scale).
REL_STEP = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10


def test_quantize_rows_round_trip_error_is_bounded(gen):
    w = torch.randn(64, 200, generator=gen) * torch.logspace(-3, 2, 64)[:, None]
    w[3] = 0.0  # an all-zero row: scale stays finite, values stay zero
    q, scale = fg.quantize_rows(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (64,) and torch.isfinite(scale).all() and (scale > 0).all()
    back = fg.dequantize_rows(q, scale)
    assert torch.equal(back[3], torch.zeros(200))
    bound = REL_STEP * w.abs() + SUBNORMAL_HALF_STEP * scale[:, None] + 1e-12
    assert ((back - w).abs() <= bound).all()
    # Each row's largest magnitude maps to ±448 exactly.
    assert torch.allclose(q.float().abs().amax(dim=1)[w.abs().amax(dim=1) > 0], torch.tensor(448.0))


def test_quantize_rows_is_idempotent(gen):
    """Quantizing dequantized FP8 weights again gives the same values (what loading a
    per-channel checkpoint as float weights relies on)."""
    q, scale = fg.quantize_rows(torch.randn(32, 96, generator=gen))
    q2, scale2 = fg.quantize_rows(fg.dequantize_rows(q, scale))
    torch.testing.assert_close(scale2, scale, rtol=1e-6, atol=0)
    assert torch.equal(q2.float(), q.float())


@pytest.mark.parametrize("m, k", [(1, 64), (5, 300), (3, 2500)])
def test_per_token_quant_kernel_matches_reference(gen, device, m, k):
    x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16).to(device)
    x[0, :7] = 0.0
    q, scale = fg.per_token_quant(x)
    q_ref, scale_ref = fg.per_token_quant_ref(x)
    assert scale.shape == (m, 1) and q.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(scale, scale_ref, rtol=1e-6, atol=0)
    # Division results may differ in the last bit, which can move a value across a rounding
    # boundary: at most one FP8 step.
    diff = (q.float() - q_ref.float()).abs()
    assert (diff <= REL_STEP * q_ref.float().abs() + 2.0**-9).all()


@pytest.mark.parametrize("rows, hidden", [(1, 64), (6, 300), (3, 2048)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_matches_norm_then_quant(gen, device, rows, hidden, with_residual):
    """The RMSNorm with per-token FP8 quantization fused in: the same residual, scales and FP8
    values as the norm (as it would be stored in bf16) followed by `per_token_quant`."""
    from inferengine.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_fp8, rms_norm_ref

    x = (torch.randn(rows, hidden, generator=gen) * 2).to(torch.bfloat16).to(device)
    residual = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).to(device)
    weight = (1 + 0.5 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(device)
    x[0] = 0.0
    residual[0] = 0.0  # an all-zero row either way: the smallest scale, zeros out
    summed = (x.float() + residual.float()).to(torch.bfloat16) if with_residual else x
    normed = rms_norm_ref(summed, weight, 1e-6)
    q_ref, scale_ref = fg.per_token_quant_ref(normed)
    x_in = x.clone()
    out, res = rms_norm_fp8(x, weight, 1e-6, residual.clone() if with_residual else None)
    assert isinstance(out, fg.Fp8Input) and out.shape == x.shape and out.dtype == torch.bfloat16
    assert torch.equal(x, x_in)  # only the residual is written
    assert torch.equal(res, summed) if with_residual else res is None
    # The unfused kernels it replaces (norm, then per-token quantization): the same bytes.
    if with_residual:
        chained, _ = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    else:
        chained = rms_norm(x, weight, 1e-6)
    q_chain, scale_chain = fg.per_token_quant(chained)
    assert torch.equal(out.q.view(torch.uint8), q_chain.view(torch.uint8))
    assert torch.equal(out.scale, scale_chain)
    torch.testing.assert_close(out.scale, scale_ref, rtol=1e-6, atol=0)
    diff = (out.q.float() - q_ref.float()).abs()
    assert (diff <= REL_STEP * q_ref.float().abs() + 2.0**-9).all()
    assert torch.equal(out.q[0].float(), torch.zeros(hidden, device=device))
    assert out.scale[0].item() == torch.tensor(fg.MIN_SCALE).item()  # float32


def test_fp8_input_off_cuda_is_dequantized(gen):
    """An `Fp8Input` where `_scaled_mm` cannot run: dequantized, then the usual path."""
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    xq, x_scale = fg.per_token_quant_ref(x)
    w, scale = fg.quantize_rows(torch.randn(48, 64, generator=gen))
    quantized = fg.Fp8Input(xq, x_scale, x.shape, x.dtype)
    out = fg.fp8_linear(quantized, w, scale)
    assert torch.equal(out, fg.fp8_linear(quantized.dequantize(), w, scale))
    want = fg.fp8_linear_ref(x, w, scale, quantize_input=True)  # in float32: bf16 roundings
    torch.testing.assert_close(out.float(), want.float(), atol=0.06, rtol=0.02)
    assert not fg.takes_fp8_input(x, w)  # nothing hands FP8 inputs over on the CPU


def make_fp8(gen, m: int, n: int, k: int, bias: bool = False, device: str = "cpu"):
    x = torch.randn(m, k, generator=gen).to(dtype=torch.bfloat16, device=device)
    w, scale = fg.quantize_rows(torch.randn(n, k, generator=gen) / k**0.5)
    b = torch.randn(n, generator=gen).to(dtype=torch.bfloat16, device=device) if bias else None
    return x, w.to(device), scale.to(device), b


def expected(x, w, scale, b) -> torch.Tensor:
    """The float32 reference, not rounded."""
    return fg.fp8_linear_ref(x.float(), w, scale, None if b is None else b.float())


TOL = {"atol": 1e-3, "rtol": 8e-3}  # one bf16 rounding of an fp32 sum, as the bf16 kernel's


@pytest.mark.parametrize("method", ["dot", "tma", "fma"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a16_skinny_matches_reference(gen, device, method, m, bias):
    """N and K not multiples of the tile, K split in three (ragged last split)."""
    if method == "fma" and m > 4:
        pytest.skip("the FMA method is for M <= 4")
    x, w, scale, b = make_fp8(gen, m, 100, 304, bias=bias, device=device)
    buffer = torch.full((m, 105), float("nan"), dtype=x.dtype, device=device)
    out = skinny_linear(
        x, w, b, out=buffer[:, :100], config=SkinnyConfig(16, 32, 3, method=method),
        weight_scale=scale,
    )  # fmt: skip
    assert buffer[:, 100:].isnan().all() and not out.isnan().any()
    torch.testing.assert_close(out.float(), expected(x, w, scale, b), **TOL)
    torch.testing.assert_close(out, skinny_linear_ref(x, w, b, scale), atol=0.02, rtol=0.01)


@pytest.mark.parametrize(
    "config",
    [
        SkinnyConfig(4, 2048, 1, num_warps=4, method="fma"),
        SkinnyConfig(8, 1024, 2, num_warps=8, method="fma"),
        SkinnyConfig(4, 512, 3, num_warps=2, method="fma", vec_k=8),
        SkinnyConfig(4, 512, 3, num_warps=2, method="fma", w_ahead=False),
    ],
)
@pytest.mark.parametrize("m", [1, 3])
def test_w8a16_fma_long_k_tiles(gen, device, config, m):
    """The FP8 sweep's longer FMA tiles (benchmarks/skinny_gemm.py FP8_FMA_TILES): a K block
    longer than K's ragged tail, and a split; W read 8 K at a time (vec_k=8), and with every
    tile read after the PDL wait (w_ahead off)."""
    x, w, scale, b = make_fp8(gen, m, 20, 4100, bias=True, device=device)
    out = skinny_linear(x, w, b, config=config, weight_scale=scale)
    torch.testing.assert_close(out.float(), expected(x, w, scale, b), **TOL)


@pytest.mark.parametrize("reduce", ["serial", "kernel", "atomic"])
def test_w8a16_reduce_modes(gen, device, reduce):
    x, w, scale, b = make_fp8(gen, 6, 40, 160, bias=True, device=device)
    out = skinny_linear(x, w, b, config=SkinnyConfig(16, 32, 2, reduce=reduce), weight_scale=scale)
    torch.testing.assert_close(out.float(), expected(x, w, scale, b), **TOL)


def test_w8a16_default_config(gen, device):
    """No config given: the FP8 table (empty until the GPU sweep) falls back to the default,
    FMA at M <= 2."""
    for m in (1, 8):
        x, w, scale, _ = make_fp8(gen, m, 48, 256, device=device)
        out = skinny_linear(x, w, weight_scale=scale)
        torch.testing.assert_close(out.float(), expected(x, w, scale, None), **TOL)


def test_fp8_linear_dequantizes_on_cpu(gen):
    """The CPU path: W dequantized to x's dtype, x left as it is (W8A16)."""
    x = torch.randn(7, 64, generator=gen)
    w, scale = fg.quantize_rows(torch.randn(48, 64, generator=gen))
    b = torch.randn(48, generator=gen)
    out = fg.fp8_linear(x, w, scale, b)
    torch.testing.assert_close(out, fg.fp8_linear_ref(x, w, scale, b), atol=1e-5, rtol=1e-5)


def _cpu_scaled_mm() -> bool:
    """Whether this torch has `_scaled_mm` on the CPU with row-wise scales and a bf16 result
    (asked of torch alone, so an error of ours cannot pass for its absence)."""
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    b = torch.ones(16, 32).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(
            a, b.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU _scaled_mm")
def test_scaled_mm_layout_on_cpu(gen):
    """`scaled_mm_linear`'s argument layout (W transposed, scales [M, 1] and [1, N]) through
    torch's CPU `_scaled_mm`, where this torch has one."""
    x = torch.randn(2, 3, 64, generator=gen).to(torch.bfloat16)
    w, scale = fg.quantize_rows(torch.randn(48, 64, generator=gen))
    b = torch.randn(48, generator=gen).to(torch.bfloat16)
    out = fg.scaled_mm_linear(x, w, scale, b)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
    want = fg.fp8_linear_ref(x, w, scale, b, quantize_input=True)
    torch.testing.assert_close(out.float(), want.float(), atol=0.05, rtol=0.02)


# ---- GPU: real shapes ------------------------------------------------------------------------

QWEN_SHAPES = [(4608, 3584, True), (3584, 3584, False), (37888, 3584, False), (3584, 18944, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n, k, bias", QWEN_SHAPES)
@pytest.mark.parametrize("m", [1, 4, 32, 33, 256])
def test_fp8_linear_real_shapes_gpu(gen, n, k, bias, m):
    """Whichever path `fp8_linear` takes (W8A16 up to M=32, `_scaled_mm` past it): against
    the reference that rounds x the same way (per token for `_scaled_mm`)."""
    x, w, scale, b = make_fp8(gen, m, n, k, bias=bias, device="cuda")
    out = fg.fp8_linear(x, w, scale, b)
    w8a8 = not fg.use_w8a16(m, n, k)
    want = fg.fp8_linear_ref(x, w, scale, b, quantize_input=w8a8).float()
    excess = ((out.float() - want).abs() - 0.02 * want.abs()).max().item()
    assert excess <= 0.02, f"M={m} N={n} K={k}: off by {excess} past 2%"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 64, 300])
def test_scaled_mm_vs_reference_gpu(gen, m):
    x, w, scale, b = make_fp8(gen, m, 4608, 3584, bias=True, device="cuda")
    out = fg.scaled_mm_linear(x, w, scale, b)
    want = fg.fp8_linear_ref(x, w, scale, b, quantize_input=True).float()
    excess = ((out.float() - want).abs() - 0.02 * want.abs()).max().item()
    assert excess <= 0.02
    out16 = fg.scaled_mm_linear(x.half(), w, scale, b.half())
    assert out16.dtype == torch.float16
    torch.testing.assert_close(out16.float(), out.float(), atol=0.05, rtol=0.02)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a GPU with FP8 tensor cores (compute capability 8.9+)",
)
@pytest.mark.parametrize("m", [1, 32, 33, 256])
def test_rms_norm_hands_fp8_to_its_linear_gpu(gen, m):
    """An FP8 qkv_proj after an RMSNorm: past the W8A16 range the norm quantizes for it, and
    the projection matches the unfused norm + `fp8_linear`; within it, nothing changes."""
    from inferengine.model.layers.linear import QKVParallelLinear
    from inferengine.model.layers.norm import RMSNorm
    from inferengine.model.quantization.fp8 import Fp8Config

    hidden = 3584
    with torch.device("cuda"):  # built FP8, as the loader builds it
        proj = QKVParallelLinear(
            hidden, 128, 28, 4, bias=True, quant_config=Fp8Config(None, torch.bfloat16)
        )
    proj.bias.data = proj.bias.data.to(torch.bfloat16)
    proj.quant_method.set_weight(proj, torch.randn(4608, hidden, generator=gen) / hidden**0.5)
    proj.bias.data.copy_(torch.randn(4608, generator=gen))
    norm = RMSNorm(hidden).to("cuda", torch.bfloat16)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(hidden, generator=gen))
    x = torch.randn(m, hidden, generator=gen).to("cuda", torch.bfloat16)
    residual = torch.randn(m, hidden, generator=gen).to("cuda", torch.bfloat16)

    fused_in, fused_res = norm(x.clone(), residual.clone(), proj)
    plain_in, plain_res = norm(x.clone(), residual.clone())
    assert isinstance(fused_in, fg.Fp8Input) == (m > fg.DEFAULT_W8A16_MAX_M)
    torch.testing.assert_close(fused_res, plain_res, atol=0, rtol=0)
    torch.testing.assert_close(proj(fused_in), proj(plain_in), atol=0.02, rtol=0.02)
