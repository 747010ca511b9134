"""Skinny GEMM against the float32 torch reference: small shapes in the interpreter (or on a GPU),
the real Qwen2.5-7B / Llama-3-8B linears on a GPU."""

import pytest
import torch

from inferengine.kernels import skinny_gemm as sg
from inferengine.kernels.skinny_gemm import SkinnyConfig, skinny_linear, skinny_linear_ref
from inferengine.kernels.triton_utils import tma_ready

# One rounding of an fp32 sum (the kernel's and the reference's fp32 sums differ in order only).
TOL = {torch.bfloat16: {"atol": 1e-3, "rtol": 8e-3}, torch.float16: {"atol": 1e-3, "rtol": 1e-3}}
METHODS = ["dot", "tma", "fma"]


def make(gen, m: int, n: int, k: int, dtype=torch.bfloat16, bias: bool = False, device="cpu"):
    x = torch.randn(m, k, generator=gen).to(dtype=dtype, device=device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype=dtype, device=device)
    b = torch.randn(n, generator=gen).to(dtype=dtype, device=device) if bias else None
    return x, w, b


def expected(x, w, b) -> torch.Tensor:
    """The float32 reference (not rounded)."""
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())


def run_poisoned(x, w, b, config):
    """Output written into a NaN-filled buffer with spare columns, which must stay NaN."""
    n = w.shape[0]
    buffer = torch.full((x.shape[0], n + 5), float("nan"), dtype=x.dtype, device=x.device)
    out = skinny_linear(x, w, b, out=buffer[:, :n], config=config)
    assert out.data_ptr() == buffer.data_ptr()
    assert buffer[:, n:].isnan().all(), "wrote past N"
    assert not out.isnan().any(), "left outputs unwritten"
    return out


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 16, 24, 31, 32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("method", ["dot", "tma"])
def test_split_k_ragged(gen, device, m, bias, method):
    """N and K not multiples of the tile; K split in three, the last split shorter. (K=296
    keeps rows 16-byte aligned for TMA.)"""
    x, w, b = make(gen, m, 100, 296, bias=bias, device=device)
    assert method != "tma" or (tma_ready(x, 16, 32) and tma_ready(w, 16, 32))
    out = run_poisoned(x, w, b, SkinnyConfig(16, 32, split_k=3, method=method))
    torch.testing.assert_close(out.float(), expected(x, w, b), **TOL[x.dtype])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_fma_split_k_ragged(gen, device, m, bias):
    x, w, b = make(gen, m, 37, 200, bias=bias, device=device)
    out = run_poisoned(x, w, b, SkinnyConfig(8, 64, split_k=2, method="fma"))
    torch.testing.assert_close(out.float(), expected(x, w, b), **TOL[x.dtype])


@pytest.mark.parametrize("w_ahead", [True, False])
@pytest.mark.parametrize("k", [32, 64, 200])
@pytest.mark.parametrize("split_k", [1, 3])
def test_fma_first_tile_read_ahead(gen, device, w_ahead, k, split_k):
    """The FMA program's first W tile, read before the PDL wait and used outside the loop:
    splits of one tile, of several, and a ragged last one."""
    x, w, b = make(gen, 2, 37, k, bias=True, device=device)
    cfg = SkinnyConfig(8, 32, split_k=split_k, method="fma", w_ahead=w_ahead)
    out = run_poisoned(x, w, b, cfg)
    torch.testing.assert_close(out.float(), expected(x, w, b), **TOL[x.dtype])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_split_even_k(gen, device, method, dtype):
    """K a multiple of BLOCK_K (unmasked loads), one split: the program stores directly."""
    x, w, b = make(gen, 6, 48, 256, dtype=dtype, bias=True, device=device)
    out = run_poisoned(x, w, b, SkinnyConfig(16, 64, split_k=1, method=method))
    torch.testing.assert_close(out.float(), expected(x, w, b), **TOL[dtype])
    torch.testing.assert_close(out, skinny_linear_ref(x, w, b), atol=0.02, rtol=0.01)


def test_tma_falls_back_when_rows_are_unaligned(gen, device):
    """K=300 bf16 rows are 600 bytes, not a multiple of 16: TMA cannot take them."""
    x, w, b = make(gen, 4, 40, 300, bias=True, device=device)
    out = run_poisoned(x, w, b, SkinnyConfig(16, 64, split_k=2, method="tma"))
    torch.testing.assert_close(out.float(), expected(x, w, b), **TOL[x.dtype])


@pytest.mark.parametrize("reduce", ["serial", "kernel", "atomic"])
@pytest.mark.parametrize("m", [3, 16])
def test_reduce_modes(gen, device, reduce, m):
    x, w, b = make(gen, m, 40, 160, bias=True, device=device)
    method = "dot" if m > 8 else "fma"
    out = run_poisoned(x, w, b, SkinnyConfig(16, 32, split_k=4, method=method, reduce=reduce))
    torch.testing.assert_close(out.float(), expected(x, w, b), **TOL[x.dtype])


@pytest.mark.parametrize("method", METHODS)
def test_serial_and_kernel_reduce_are_bitwise_equal_and_repeatable(gen, device, method):
    """Both deterministic modes add the split partials in split order: identical bits, every
    call (the serial mode's counters are left zero for the next launch)."""
    x, w, b = make(gen, 5, 50, 320, bias=True, device=device)
    cfgs = [SkinnyConfig(16, 32, 5, method=method, reduce=r) for r in ("serial", "kernel")]
    first = skinny_linear(x, w, b, config=cfgs[0])
    for cfg in [*cfgs, cfgs[0]]:
        assert torch.equal(skinny_linear(x, w, b, config=cfg), first)


def test_leading_dims_and_default_config(gen, device):
    x, w, b = make(gen, 6, 70, 96, bias=True, device=device)
    x3 = x.view(2, 3, 96)
    out = skinny_linear(x3, w, b)
    assert out.shape == (2, 3, 70)
    torch.testing.assert_close(out.view(6, 70).float(), expected(x, w, b), **TOL[x.dtype])
    assert skinny_linear(x[:0], w).shape == (0, 70)


def test_num_splits_covers_k_without_empty_splits():
    for k in (1, 31, 32, 300, 3584, 18944):
        for block_k in (16, 32, 128, 256):
            for split_k in (1, 2, 3, 5, 8, 64, 1000):
                splits, per_split = sg.num_splits(k, block_k, split_k)
                assert per_split % block_k == 0 and 1 <= splits <= max(1, split_k)
                assert (splits - 1) * per_split < k <= splits * per_split


def test_configs_are_valid():
    shapes = [(4608, 3584), (3584, 18944), (37888, 3584), (152064, 3584), (100, 50)]
    chosen = [sg.default_config(m, n, k, 132) for m in range(1, 33) for n, k in shapes]
    for n, k, bucket in sg.CONFIGS:
        assert bucket == sg.m_bucket(bucket) <= sg.MAX_M and n > 0 and k > 0
    for cfg in [*chosen, *sg.CONFIGS.values(), *sg.FP8_CONFIGS.values()]:
        for size in (cfg.block_n, cfg.block_k, cfg.num_warps):
            assert size & (size - 1) == 0
        assert cfg.reduce in sg.REDUCE_MODES and cfg.method in sg.METHODS and cfg.split_k >= 1
        assert cfg.method == "fma" or min(cfg.block_n, cfg.block_k) >= 16
        assert cfg.vec_k in (0, 8, 16) and (cfg.vec_k == 0 or cfg.method == "fma")
    assert sg.m_bucket(24) == 32 and sg.m_pad(3, "dot") == 16 and sg.m_pad(3, "fma") == 4


def test_choose_config_takes_the_next_listed_bucket(monkeypatch):
    tuned = SkinnyConfig(32, 256, 2, method="tma")
    monkeypatch.setattr(sg, "CONFIGS", {(4096, 4096, 4): tuned})  # only this entry
    assert sg.choose_config(1, 4096, 4096, 132) is tuned  # buckets 1 and 2 unlisted
    assert sg.choose_config(3, 4096, 4096, 132) is tuned
    assert sg.choose_config(5, 4096, 4096, 132) == sg.default_config(5, 4096, 4096, 132)
    assert sg.choose_config(3, 4096, 1024, 132) == sg.default_config(3, 4096, 1024, 132)


def test_supports_needs_cuda(device):
    x, w = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=torch.bfloat16)
    assert not sg.supports(x, w)
    if device == "cuda":
        assert sg.supports(x.cuda(), w.cuda())
        assert not sg.supports(torch.zeros(33, 64, dtype=torch.bfloat16).cuda(), w.cuda())
        assert not sg.supports(x.float().cuda(), w.float().cuda())


REAL = sg.DECODE_LINEAR_SHAPES
_real_weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}


def real_weights(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random weights of a real shape, made on the GPU once per session (one shape kept)."""
    if name not in _real_weights:
        _real_weights.clear()
        n, k, bias = REAL[name]
        g = torch.Generator("cuda").manual_seed(n + k)
        w = torch.randn(n, k, generator=g, device="cuda").div_(k**0.5).to(torch.bfloat16)
        b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16) if bias else None
        _real_weights[name] = (w, b)
    return _real_weights[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(REAL))
@pytest.mark.parametrize("m", [1, 3, 8, 16, 24, 32])
@pytest.mark.parametrize("variant", ["table", "tma", "fma", "atomic"])
def test_real_shapes(gen, name, m, variant):
    """The table's config (or the heuristic), TMA, the fp32-FMA path and atomic split-K, against
    the fp32 reference and cuBLAS; the table's config twice gives identical bits."""
    n, k, _ = REAL[name]
    w, b = real_weights(name)
    x = torch.randn(m, k, generator=gen).to(dtype=torch.bfloat16, device="cuda")
    cfg = sg.choose_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
    if variant == "tma":
        cfg = SkinnyConfig(64, 128, cfg.split_k, num_stages=4, method="tma")
    elif variant == "fma":
        if m > 8:
            pytest.skip("the fma path is for M <= 8")
        cfg = SkinnyConfig(8, 512, cfg.split_k, method="fma")
    elif variant == "atomic":
        if m not in (3, 16):
            pytest.skip("atomic split-K is checked at two sizes")
        cfg = SkinnyConfig(64, 128, 4, method="dot", reduce="atomic")
    assert sg.supports(x, w)
    out = run_poisoned(x, w, b, cfg)
    torch.testing.assert_close(out.float(), expected(x, w, b), **TOL[x.dtype])
    cublas = torch.nn.functional.linear(x, w, b)
    torch.testing.assert_close(out, cublas, atol=0.02, rtol=0.016)
    if variant == "table":
        assert torch.equal(skinny_linear(x, w, b, config=cfg), out), "not deterministic"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reduce", ["serial", "kernel"])
def test_cuda_graph_replay(gen, reduce):
    """Captured with the serial counters in use: replays match eager, bit for bit."""
    x, w, b = make(gen, 16, 3584, 18944, device="cuda")
    cfg = SkinnyConfig(64, 128, 8, num_stages=4, method="tma", reduce=reduce)
    eager = skinny_linear(x, w, b, config=cfg)
    out = torch.empty_like(eager)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        skinny_linear(x, w, b, out=out, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_linear(x, w, b, out=out, config=cfg)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out.float(), expected(x, w, b), **TOL[x.dtype])
