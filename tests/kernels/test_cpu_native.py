"""Our C++ CPU kernels against torch references on fresh random inputs: the activations'
int8 terms exactly, the block-quantized GEMMs to float32 rounding of the same arithmetic, the
packing's round trip, decode attention with rotary and the K/V store, RMSNorm and SiLU·mul
(bit for bit in bfloat16, as the torch path rounds)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import zlib

import pytest
import torch
import torch.nn.functional as F

from inferengine.kernels import cpu_native
from inferengine.kernels.cpu_native import (
    BLOCK,
    cpu_flags,
    dequantize_q4,
    dequantize_q8,
    pack_q4,
    pack_q8,
    qlinear_reference,
    quantize_blocks_reference,
)

x86_with_compiler = (
    platform.machine().lower() in ("x86_64", "amd64")
    and {"avx2", "fma", "f16c"} <= cpu_flags()
    and shutil.which("c++") is not None
)


@pytest.fixture(scope="module")
def ops():
    ops = cpu_native.native_ops()
    if ops is None:
        if x86_with_compiler:  # CI's machines: the kernels must build, not skip
            pytest.fail(f"our CPU kernels did not build: {cpu_native.unavailable_reason()}")
        pytest.skip(f"no CPU kernels here: {cpu_native.unavailable_reason()}")
    return ops


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def test_cpu_flags_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 fma f16c avx512_vnni\n\n")
    assert {"avx2", "avx512_vnni"} <= cpu_flags.__wrapped__(info)
    assert cpu_flags.__wrapped__(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_terms_match_the_reference(ops, gen, terms, dtype):
    x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
    x[2, 32:64] = 0  # an all-zero block: scale 0, values 0
    q, d, scaled_sum = ops.quantize_blocks(x, terms)
    ref_q, ref_d = quantize_blocks_reference(x, terms)
    assert torch.equal(q, ref_q) and torch.equal(d, ref_d)
    per_term = q.float().view(7, terms, 3, BLOCK).sum(-1) * d
    torch.testing.assert_close(scaled_sum, per_term.sum(1))
    recon = (q.float().view(7, terms, 3, BLOCK) * d.unsqueeze(-1)).sum(1).view(7, 96)
    # Half a step of each term's grid: max/254 for one term, max/254² (about 2^-16) for two.
    bound = {1: 1.0001 / 254, 2: 2**-15}[terms]
    block_max = x.float().view(7, 3, BLOCK).abs().amax(-1, keepdim=True)
    assert ((recon - x.float()).view(7, 3, BLOCK).abs() <= bound * block_max).all()


def _q4_weight(gen, n: int, k: int, exact_fp16: bool):
    u = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // BLOCK, generator=gen) * 0.02
    offset = -torch.rand(n, k // BLOCK, generator=gen) * 0.1
    if exact_fp16:  # GGUF's Q4_0 / Q4_1 scales; Q4_K's products are float32
        scale, offset = scale.half().float(), offset.half().float()
    return u, scale, offset


SHAPES = [(1, 960, 576), (3, 64, 96), (5, 3, 32), (7, 44, 64), (16, 576, 192), (33, 40, 64)]


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_q4_gemm_matches_the_reference(ops, gen, m, n, k, dtype, terms):
    u, scale, offset = _q4_weight(gen, n, k, exact_fp16=(m % 2 == 1))
    packed = pack_q4(u, scale, offset)
    assert packed[1].dtype == (torch.float16 if m % 2 == 1 else torch.float32)
    w = dequantize_q4(*packed)
    assert torch.equal(w[n:], torch.zeros_like(w[n:]))  # padded rows
    torch.testing.assert_close(w[:n], u.float().view(n, -1, BLOCK).mul(scale[..., None]).add(
        offset[..., None]).view(n, k), rtol=0, atol=0)  # fmt: skip
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m > 3 else None
    y = ops.qlinear_q4(x, *packed, bias, n, terms)
    expected = qlinear_reference(x, w[:n], terms).float() + (0 if bias is None else bias.float())
    assert y.shape == (m, n) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2**-8  # float32 sums; bf16 output rounding
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol * expected.abs().max())


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_q8_gemm_matches_the_reference(ops, gen, m, n, k, dtype, terms):
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = (torch.rand(n, k // BLOCK, generator=gen) * 0.01).half().float()
    packed = pack_q8(q, scale)
    w = dequantize_q8(packed[0], packed[2])
    torch.testing.assert_close(w[:n], (q.float().view(n, -1, BLOCK) * scale[..., None]).view(n, k))
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m > 3 else None
    y = ops.qlinear_q8(x, *packed, bias, n, terms)
    expected = qlinear_reference(x, w[:n], terms).float() + (0 if bias is None else bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(y.float(), expected, rtol=tol, atol=tol * expected.abs().max())


def test_two_terms_are_close_to_the_float_product(ops, gen):
    """Against the unquantized activations, two terms err ~2^-15 of a block's largest value,
    one term ~2^-8: the reason the layers use two."""
    u, scale, offset = _q4_weight(gen, 256, 512, exact_fp16=True)
    packed = pack_q4(u, scale, offset)
    x = torch.randn(4, 512, generator=gen)
    exact = x.double() @ dequantize_q4(*packed).double().t()
    err = {t: (ops.qlinear_q4(x, *packed, None, 256, t) - exact).abs().max() for t in (1, 2)}
    assert err[2] < 1e-4 * exact.abs().max() < err[1] / 10


def test_q8_refuses_minus_128_and_bad_shapes(ops):
    with pytest.raises(ValueError, match=r"-127\.\.127"):
        pack_q8(torch.full((8, 32), -128, dtype=torch.int8), torch.ones(8, 1))
    with pytest.raises(ValueError, match=r"multiple of 32"):
        pack_q4(torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1))
    packed = pack_q8(torch.ones(8, 64, dtype=torch.int8), torch.ones(8, 2))
    with pytest.raises(RuntimeError, match="features"):
        ops.qlinear_q8(torch.randn(2, 32), *packed, None, 8, 2)


def _attention_reference(q, k, v, cache, slots, table, seq_lens, positions, cos_sin, scale,
                         window, cap):  # fmt: skip
    """Rotary on q and k (NeoX halves of the first rotary_dim dims), K/V stored, then each
    query over its sequence's pages in float64."""
    cache = cache.clone()
    b_count, hq, d = q.shape
    hkv, bs = k.shape[1], cache.shape[2]
    rot = 0 if cos_sin is None else cos_sin.shape[1]

    def rotate(x, pos):
        x = x.double().clone()
        if rot:
            c, s = cos_sin[pos, : rot // 2].double(), cos_sin[pos, rot // 2 :].double()
            a, b = x[..., : rot // 2].clone(), x[..., rot // 2 : rot].clone()
            x[..., : rot // 2], x[..., rot // 2 : rot] = a * c - b * s, b * c + a * s
        return x

    flat = cache.view(2, -1, hkv, d)
    out = torch.zeros(b_count, hq, d, dtype=torch.float64)
    for b in range(b_count):
        pos = int(positions[b]) if positions is not None else 0
        flat[0, slots[b]] = rotate(k[b], pos).to(cache.dtype)
        flat[1, slots[b]] = v[b].to(cache.dtype)
        n = int(seq_lens[b])
        rows = torch.tensor([int(table[b, j // bs]) * bs + j % bs for j in range(n)])
        keys, values = flat[0, rows].double(), flat[1, rows].double()
        qr = rotate(q[b], pos)
        for h in range(hq):
            s = keys[:, h // (hq // hkv)] @ qr[h] * scale
            if cap:
                s = cap * torch.tanh(s / cap)
            if window:
                s[: max(0, n - window)] = float("-inf")
            out[b, h] = torch.softmax(s, 0) @ values[:, h // (hq // hkv)]
    return out, cache


@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
     (torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
)  # fmt: skip
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "rotary_dim", "window", "cap"),
    [(9, 3, 64, 64, 0, 0.0), (8, 2, 64, 32, 5, 0.0), (4, 4, 24, 24, 0, 30.0), (6, 1, 128, 0, 0, 0.0)],
)  # fmt: skip
def test_decode_attention_matches_the_reference(ops, gen, q_dtype, cache_dtype, heads, kv_heads,
                                                head_dim, rotary_dim, window, cap):  # fmt: skip
    batch, block_size, pages = 4, 16, 8
    cache = torch.randn(2, batch * pages + 1, block_size, kv_heads, head_dim, generator=gen)
    cache = cache.to(cache_dtype)
    seq_lens = torch.randint(1, pages * block_size, (batch,), generator=gen, dtype=torch.int32)
    table = (torch.randperm(batch * pages, generator=gen) + 1).view(batch, pages).int()
    wide = torch.zeros(batch, pages + 3, dtype=torch.int32)
    wide[:, :pages] = table  # a strided view of a wider table, as the runner passes
    last = seq_lens.long() - 1
    slots = table.long().gather(1, (last // block_size)[:, None])[:, 0] * block_size
    slots += last % block_size
    cos_sin = torch.randn(200, rotary_dim, generator=gen) if rotary_dim else None
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=gen).to(q_dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q, k, v = (t.view(batch, -1, head_dim) for t in (q, k, v))  # strided rows, as split gives
    scale = head_dim**-0.5
    positions = last if rotary_dim else None
    expected, expected_cache = _attention_reference(
        q, k, v, cache, slots, table, seq_lens, positions, cos_sin, scale, window, cap
    )
    mine = cache.clone()
    out = ops.decode_attention(q, k, v, mine, slots, wide[:, :pages], seq_lens, positions,
                               cos_sin, scale, window, cap)  # fmt: skip
    assert out.dtype == q_dtype and out.shape == (batch, heads, head_dim)
    stored = torch.float32 if cache_dtype == torch.float32 and q_dtype == torch.float32 else None
    atol = 1e-6 if stored else 1e-2
    torch.testing.assert_close(mine.float(), expected_cache.float(), rtol=0, atol=atol)
    tol = 1e-5 if q_dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 20])
def test_rms_norm_and_residual_add_match_the_torch_path(ops, gen, dtype, hidden):
    from inferengine.model.layers.norm import RMSNorm

    x = torch.randn(5, hidden, generator=gen).to(dtype)
    residual = torch.randn(5, hidden, generator=gen).to(dtype)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    expected = norm._norm(x)
    expected_sum = x + residual
    expected_with = norm._norm(expected_sum)
    got = ops.rms_norm(x.clone(), None, norm.weight, 1e-5)
    xs, rs = x.clone(), residual.clone()
    got_with = ops.rms_norm(xs, rs, norm.weight, 1e-5)
    assert got_with.data_ptr() == xs.data_ptr()  # in place, as the CUDA kernel
    assert torch.equal(rs, expected_sum)
    if dtype == torch.bfloat16:  # the torch path's roundings, bit for bit
        assert torch.equal(got, expected) and torch.equal(got_with, expected_with)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_with, expected_with, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1536, 20])
def test_silu_and_mul_matches_torch(ops, gen, dtype, width):
    x = (torch.randn(3, 2, width, generator=gen) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = ops.silu_and_mul(x)
    assert got.shape == (3, 2, width // 2)
    if dtype == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_kernels_off_by_environment(monkeypatch):
    monkeypatch.setenv("INFERENGINE_CPU_KERNELS", "0")
    assert cpu_native.native_ops.__wrapped__() is None
    assert cpu_native.unavailable_reason() == "INFERENGINE_CPU_KERNELS=0"
    monkeypatch.setenv("INFERENGINE_CPU_KERNELS", "sse")
    assert cpu_native.native_ops.__wrapped__() is None
    assert "not 1, 0 or avx2" in str(cpu_native.unavailable_reason())


_AVX2_CHECK = """
import torch
from inferengine.kernels import cpu_native as cn
from inferengine.kernels.cpu_native import BLOCK
ops = cn.native_ops()
assert ops is not None and ops.isa() == "avx2", (ops and ops.isa(), cn.unavailable_reason())
g = torch.Generator().manual_seed(0)
for m, n, k in [(1, 72, 96), (3, 44, 64), (5, 16, 32), (16, 40, 128)]:
    u = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, k // BLOCK, generator=g) * 0.02).half().float()
    offset = (-torch.rand(n, k // BLOCK, generator=g) * 0.1).half().float()
    p4, p8 = cn.pack_q4(u, scale, offset), cn.pack_q8(q, scale)
    x = torch.randn(m, k, generator=g)
    for terms in (1, 2):
        for y, w in [(ops.qlinear_q4(x, *p4, None, n, terms), cn.dequantize_q4(*p4)),
                     (ops.qlinear_q8(x, *p8, None, n, terms), cn.dequantize_q8(p8[0], p8[2]))]:
            ref = cn.qlinear_reference(x, w[:n], terms)
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
print("avx2 path ok")
"""


def test_the_avx2_path_matches_the_reference():
    """CPUs without AVX-512 or VNNI take other code (maddubs, sign moves, 16 registers): built
    that way here (INFERENGINE_CPU_KERNELS=avx2, in a process of its own) and checked."""
    if not x86_with_compiler:
        pytest.skip("needs x86-64 with AVX2 and a C++ compiler")
    env = dict(os.environ, INFERENGINE_CPU_KERNELS="avx2")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", _AVX2_CHECK],
        env=env,
        cwd=repo,  # this checkout's package, whatever is installed
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0 and "avx2 path ok" in done.stdout, done.stderr[-3000:]
