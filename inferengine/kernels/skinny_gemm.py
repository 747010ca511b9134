"""Skinny GEMM y = x @ Wᵀ (+ bias) for decode-sized M ≤ 32: Triton wrapper, config table, reference.

Decode's linears are bound by reading W once; each program streams a [BLOCK_N, K-split] slab of W
and multiplies it by all of x. W may also be FP8 with a float32 scale per output row (W8A16: half
the bytes to read; dequantized in registers), with its own config table. Hot path and CUDA-graph safe: launch shapes come from tensor
shapes and the fixed config table, never from device values. Add nothing here that syncs.
"""

from dataclasses import dataclass, replace

import torch

from inferengine.kernels.triton_utils import (
    arrival_counters,
    device_sms,
    next_power_of_2,
    pdl_launch,
    tma_ready,
    triton_available,
)

MAX_M = 32
METHODS = {"dot": 0, "tma": 1, "fma": 2}  # how W is streamed and multiplied -> kernel METHOD
REDUCE_MODES = {"serial": 2, "kernel": 1, "atomic": 3}  # split-K combine -> kernel REDUCE
_REDUCE_BLOCK = 1024
SMEM_PER_SM = 228 * 1024


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    block_n: int  # output features per program
    block_k: int  # K per inner step; each step loads a [block_n, block_k] tile of W
    split_k: int = 1  # programs sharing one N tile's K range (an upper bound; see `num_splits`)
    num_warps: int = 4
    num_stages: int = 3
    # "dot": pointer loads + tensor cores (M padded to 16); "tma": the same with TMA loads;
    # "fma": pointer loads + fp32 multiply-adds on the CUDA cores (for M <= 4 or so)
    method: str = "dot"
    reduce: str = "serial"  # how K-split partials combine: "serial", "kernel" or "atomic"
    # "fma" only: read the first W tile before waiting on the kernel before (PDL)
    w_ahead: bool = True
    # "fma" only: K elements per load of W (0: 16 bytes). FP8 W at 8 loads x and W alike, 8
    # elements a thread: at 16, x (twice W's bytes) is spread thinner and reshuffled each step.
    vec_k: int = 0


# The decode linears the configs are tuned for: name -> (N, K, has bias), Qwen2.5-7B and
# Llama-3-8B.
DECODE_LINEAR_SHAPES: dict[str, tuple[int, int, bool]] = {
    "qwen-qkv": (4608, 3584, True),
    "qwen-o": (3584, 3584, False),
    "qwen-gate-up": (37888, 3584, False),
    "qwen-down": (3584, 18944, False),
    "qwen-lm-head": (152064, 3584, False),
    "llama-qkv": (6144, 4096, False),
    "llama-o": (4096, 4096, False),
    "llama-gate-up": (28672, 4096, False),
    "llama-down": (4096, 14336, False),
    "llama-lm-head": (128256, 4096, False),
}

# Fixed configs keyed by (N, K, M bucket); `benchmarks/skinny_gemm.py --sweep` prints entries.
# No autotuning at run time: launches must be the same in and out of CUDA graphs.
# From the H100 sweep in benchmarks/results/20261122T083950Z-skinny-gemm.
CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {
    (4608, 3584, 1): SkinnyConfig(8, 512, 1, 4, 1, "fma"),  # qwen-qkv 2.51 TB/s
    (4608, 3584, 4): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # qwen-qkv 2.38 TB/s
    (4608, 3584, 16): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # qwen-qkv 2.39 TB/s
    (4608, 3584, 32): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # qwen-qkv 2.36 TB/s
    (3584, 3584, 1): SkinnyConfig(4, 1024, 1, 4, 1, "fma"),  # qwen-o 2.42 TB/s
    (3584, 3584, 4): SkinnyConfig(16, 256, 1, 4, 4, "dot"),  # qwen-o 2.10 TB/s
    (3584, 3584, 16): SkinnyConfig(16, 256, 1, 4, 4, "tma"),  # qwen-o 2.16 TB/s
    (3584, 3584, 32): SkinnyConfig(32, 256, 1, 4, 4, "tma"),  # qwen-o 2.19 TB/s
    (37888, 3584, 1): SkinnyConfig(4, 1024, 1, 4, 1, "fma"),  # qwen-gate-up 3.07 TB/s
    (37888, 3584, 4): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # qwen-gate-up 2.96 TB/s
    (37888, 3584, 16): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # qwen-gate-up 2.92 TB/s
    (37888, 3584, 32): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # qwen-gate-up 2.86 TB/s
    (3584, 18944, 1): SkinnyConfig(4, 1024, 1, 4, 1, "fma"),  # qwen-down 2.92 TB/s
    (3584, 18944, 4): SkinnyConfig(64, 128, 2, 4, 6, "dot"),  # qwen-down 2.78 TB/s
    (3584, 18944, 16): SkinnyConfig(64, 128, 2, 4, 6, "dot"),  # qwen-down 2.73 TB/s
    (3584, 18944, 32): SkinnyConfig(64, 128, 2, 4, 6, "dot"),  # qwen-down 2.67 TB/s
    (152064, 3584, 1): SkinnyConfig(4, 1024, 1, 4, 1, "fma"),  # qwen-lm-head 3.13 TB/s
    (152064, 3584, 4): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # qwen-lm-head 3.06 TB/s
    (152064, 3584, 16): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # qwen-lm-head 3.03 TB/s
    (152064, 3584, 32): SkinnyConfig(128, 128, 1, 8, 4, "dot"),  # qwen-lm-head 2.95 TB/s
    (6144, 4096, 1): SkinnyConfig(4, 1024, 1, 4, 1, "fma"),  # llama-qkv 2.75 TB/s
    (6144, 4096, 4): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # llama-qkv 2.61 TB/s
    (6144, 4096, 16): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # llama-qkv 2.56 TB/s
    (6144, 4096, 32): SkinnyConfig(64, 128, 1, 4, 6, "tma"),  # llama-qkv 2.50 TB/s
    (4096, 4096, 1): SkinnyConfig(8, 512, 1, 4, 1, "fma"),  # llama-o 2.49 TB/s
    (4096, 4096, 4): SkinnyConfig(16, 256, 1, 4, 4, "dot"),  # llama-o 2.31 TB/s
    (4096, 4096, 16): SkinnyConfig(16, 256, 1, 4, 4, "tma"),  # llama-o 2.32 TB/s
    (4096, 4096, 32): SkinnyConfig(32, 256, 1, 4, 4, "tma"),  # llama-o 2.35 TB/s
    (28672, 4096, 1): SkinnyConfig(4, 1024, 1, 4, 1, "fma"),  # llama-gate-up 3.08 TB/s
    (28672, 4096, 4): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # llama-gate-up 2.94 TB/s
    (28672, 4096, 16): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # llama-gate-up 2.89 TB/s
    (28672, 4096, 32): SkinnyConfig(64, 128, 1, 4, 4, "tma"),  # llama-gate-up 2.85 TB/s
    (4096, 14336, 1): SkinnyConfig(8, 512, 1, 4, 1, "fma"),  # llama-down 2.81 TB/s
    (4096, 14336, 4): SkinnyConfig(64, 128, 2, 4, 6, "dot"),  # llama-down 2.76 TB/s
    (4096, 14336, 16): SkinnyConfig(16, 256, 1, 4, 4, "tma"),  # llama-down 2.72 TB/s
    (4096, 14336, 32): SkinnyConfig(16, 256, 1, 4, 4, "tma"),  # llama-down 2.69 TB/s
    (128256, 4096, 1): SkinnyConfig(4, 1024, 1, 4, 1, "fma"),  # llama-lm-head 3.15 TB/s
    (128256, 4096, 4): SkinnyConfig(64, 128, 1, 4, 6, "dot"),  # llama-lm-head 3.08 TB/s
    (128256, 4096, 16): SkinnyConfig(128, 128, 1, 8, 4, "dot"),  # llama-lm-head 3.02 TB/s
    (128256, 4096, 32): SkinnyConfig(128, 128, 1, 8, 4, "dot"),  # llama-lm-head 2.97 TB/s
}


# The same for FP8 weights (W8A16), keyed alike: the Qwen2.5-7B linears from an H100 80GB HBM3
# sweep (`benchmarks/skinny_gemm.py --sweep --fp8`, 20261125T025200Z-skinny-gemm, which also
# tries FP8's longer-K and 8-warp FMA tiles; where it picked another config than the sweep
# before it within ~3%, that is run-to-run noise); the one-row entries (and their TB/s) from
# the FMA sweep with the first W tile read ahead, 20261127T132350Z-skinny-gemm; other shapes
# get `default_config`.
FP8_CONFIGS: dict[tuple[int, int, int], SkinnyConfig] = {
    (4608, 3584, 1): SkinnyConfig(8, 512, 1, 8, 1, "fma"),  # qwen-qkv 2.24 TB/s
    (4608, 3584, 2): SkinnyConfig(4, 512, 1, 8, 1, "fma"),  # qwen-qkv 1.48 TB/s
    (4608, 3584, 4): SkinnyConfig(128, 128, 7, 4, 3, "tma"),  # qwen-qkv 1.25 TB/s
    (4608, 3584, 8): SkinnyConfig(64, 128, 5, 4, 6, "tma"),  # qwen-qkv 1.26 TB/s
    (4608, 3584, 16): SkinnyConfig(64, 128, 5, 4, 6, "tma"),  # qwen-qkv 1.25 TB/s
    (4608, 3584, 32): SkinnyConfig(64, 128, 5, 4, 4, "tma"),  # qwen-qkv 1.20 TB/s
    (3584, 3584, 1): SkinnyConfig(4, 1024, 1, 4, 1, "fma"),  # qwen-o 2.15 TB/s
    (3584, 3584, 2): SkinnyConfig(4, 512, 1, 4, 1, "fma"),  # qwen-o 1.76 TB/s
    (3584, 3584, 4): SkinnyConfig(64, 128, 7, 4, 6, "tma"),  # qwen-o 1.23 TB/s
    (3584, 3584, 8): SkinnyConfig(64, 128, 7, 4, 6, "tma"),  # qwen-o 1.23 TB/s
    (3584, 3584, 16): SkinnyConfig(64, 128, 7, 4, 6, "tma"),  # qwen-o 1.22 TB/s
    (3584, 3584, 32): SkinnyConfig(64, 128, 7, 4, 4, "tma"),  # qwen-o 1.10 TB/s
    (37888, 3584, 1): SkinnyConfig(4, 512, 1, 2, 1, "fma", vec_k=8),  # qwen-gate-up 2.90 TB/s
    (37888, 3584, 2): SkinnyConfig(64, 256, 1, 4, 3, "tma"),  # qwen-gate-up 2.39 TB/s
    (37888, 3584, 4): SkinnyConfig(64, 256, 1, 4, 3, "tma"),  # qwen-gate-up 2.40 TB/s
    (37888, 3584, 8): SkinnyConfig(64, 256, 1, 4, 3, "tma"),  # qwen-gate-up 2.42 TB/s
    (37888, 3584, 16): SkinnyConfig(64, 256, 1, 4, 3, "tma"),  # qwen-gate-up 2.41 TB/s
    (37888, 3584, 32): SkinnyConfig(64, 128, 1, 4, 4, "tma"),  # qwen-gate-up 2.27 TB/s
    (3584, 18944, 1): SkinnyConfig(4, 1024, 1, 4, 1, "fma"),  # qwen-down 2.74 TB/s
    (3584, 18944, 2): SkinnyConfig(4, 512, 1, 4, 1, "fma"),  # qwen-down 2.22 TB/s
    (3584, 18944, 4): SkinnyConfig(64, 256, 7, 4, 3, "tma"),  # qwen-down 2.11 TB/s
    (3584, 18944, 8): SkinnyConfig(64, 256, 7, 4, 3, "tma"),  # qwen-down 2.10 TB/s
    (3584, 18944, 16): SkinnyConfig(64, 256, 7, 4, 3, "tma"),  # qwen-down 2.07 TB/s
    (3584, 18944, 32): SkinnyConfig(64, 128, 7, 4, 4, "tma"),  # qwen-down 1.94 TB/s
}


def m_bucket(m: int) -> int:
    """The config table's M key: the next power of two (1, 2, 4, 8, 16, 32)."""
    return next_power_of_2(m)


def m_pad(m: int, method: str) -> int:
    """Columns of the kernel's accumulator: at least 16 for tensor cores."""
    return max(1 if method == "fma" else 16, next_power_of_2(m))


def num_splits(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits launched, K per split): split boundaries fall on BLOCK_K, and no split is empty."""
    k_tiles = -(-k // block_k)
    tiles_per_split = -(-k_tiles // max(1, split_k))
    return -(-k_tiles // tiles_per_split), tiles_per_split * block_k


def programs_per_sm(cfg: SkinnyConfig, m: int, w_bytes: int = 2) -> int:
    """Programs an SM holds at once, as the shared memory of the load pipeline allows (W and x
    tiles per stage; 228 KiB per SM as on H100). FMA configs use registers only: about 4.
    `w_bytes`: bytes per weight (2, or 1 for FP8); x is 16-bit."""
    if cfg.method == "fma":
        return 4
    tile_bytes = (cfg.block_n * w_bytes + m_pad(m, cfg.method) * 2) * cfg.block_k
    return max(1, min(8, SMEM_PER_SM // (cfg.num_stages * tile_bytes + 1024)))


def wave_split(cfg: SkinnyConfig, m: int, n: int, k: int, sms: int, w_bytes: int = 2) -> int:
    """The most K-splits whose programs all run at once (no straggling second wave), keeping at
    least 4 K steps per split; 1 when the N tiles alone fill the GPU."""
    tiles = -(-n // cfg.block_n)
    k_tiles = -(-k // cfg.block_k)
    return max(1, min(sms * programs_per_sm(cfg, m, w_bytes) // tiles, k_tiles // 4))


def default_config(m: int, n: int, k: int, sms: int, w_bytes: int = 2) -> SkinnyConfig:
    """Heuristic for shapes outside the table: 64-row tiles on tensor cores with a 4-stage
    pipeline (two programs per SM), K split to fill one wave. FP8 weights at M <= 2 take the
    FMA method, which every bf16 shape's M=1 entry chose."""
    if w_bytes == 1 and m <= 2:
        cfg = SkinnyConfig(4, 1024, 1, num_warps=4, num_stages=1, method="fma")
    else:
        cfg = SkinnyConfig(64, 128, 1, num_warps=4, num_stages=4, method="dot")
    return replace(cfg, split_k=wave_split(cfg, m, n, k, sms, w_bytes))


def choose_config(m: int, n: int, k: int, sms: int, fp8: bool = False) -> SkinnyConfig:
    """The table's entry for M's bucket, else for the nearest larger listed bucket (a config
    tuned for more rows also fits fewer), else `default_config`."""
    table = FP8_CONFIGS if fp8 else CONFIGS
    bucket = m_bucket(m)
    while bucket <= MAX_M:
        if (n, k, bucket) in table:
            return table[(n, k, bucket)]
        bucket *= 2
    return default_config(m, n, k, sms, 1 if fp8 else 2)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `skinny_linear` applies: CUDA, bf16/fp16 x, W of x's dtype or FP8 (e4m3),
    1 <= M <= 32, dense last dims."""
    return (
        x.is_cuda
        and weight.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype in (x.dtype, torch.float8_e4m3fn)
        and weight.dim() == 2
        and x.dim() >= 1
        and x.shape[-1] == weight.shape[1]
        and 1 <= x.numel() // max(1, x.shape[-1]) <= MAX_M
        and x.stride(-1) == 1
        and weight.stride(1) == 1
        and triton_available()
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K]ᵀ (+ bias [N]) -> [..., N] in x's dtype, as F.linear, fp32
    accumulation; at most 32 rows of x. `out` may be given (rows may be strided, last dim
    dense); `config` overrides the table (benchmarks and tests). An FP8 `weight` needs
    `weight_scale` (float32 [N]): y = x @ (weight * weight_scale[:, None])ᵀ. With PDL, FMA
    configs read W's first tile before the kernel launched just before this one has finished,
    so W must not be that kernel's output (a weight never is)."""
    from inferengine.kernels.skinny_gemm_kernels import skinny_gemm_kernel, skinny_reduce_kernel

    n, k = weight.shape
    fp8 = weight.dtype == torch.float8_e4m3fn
    assert x.shape[-1] == k and weight.stride(1) == 1, "x [..., K] and weight [N, K], K dense"
    assert (x.dtype == weight.dtype or fp8) and (bias is None or bias.shape == (n,))
    assert (weight_scale is not None) == fp8, "an FP8 weight, and only one, takes a scale"
    if weight_scale is not None:
        assert weight_scale.dtype == torch.float32 and weight_scale.shape == (n,)
        weight_scale = weight_scale.contiguous()
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    assert m <= MAX_M, f"skinny_linear takes at most {MAX_M} rows, got {m}"
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    assert out2.stride(-1) == 1 and out.dtype == x.dtype
    if m == 0:
        return out
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    cfg = config or choose_config(m, n, k, device_sms(x), fp8)
    method, pad = cfg.method, m_pad(m, cfg.method)
    x_in, w_in = x2, weight
    if method == "tma":
        if tma_ready(x2, pad, cfg.block_k) and tma_ready(weight, cfg.block_n, cfg.block_k):
            from triton.tools.tensor_descriptor import TensorDescriptor

            x_in = TensorDescriptor.from_tensor(x2, [pad, cfg.block_k])
            w_in = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
        else:
            method = "dot"
    splits, k_per_split = num_splits(k, cfg.block_k, cfg.split_k)
    tiles = -(-n // cfg.block_n)
    mode = 0 if splits == 1 else REDUCE_MODES[cfg.reduce]
    counters = partials = out2  # placeholders where unused
    if mode == REDUCE_MODES["serial"]:
        found = arrival_counters(x.device, tiles)
        if found is None:
            mode = REDUCE_MODES["kernel"]  # same sums in the same order, one more launch
        else:
            counters = found
    if mode == REDUCE_MODES["atomic"]:
        partials = torch.zeros((1, m, n), dtype=torch.float32, device=x.device)
    elif mode:
        partials = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    bias_in = bias if bias is not None else out2
    skinny_gemm_kernel[(tiles, splits)](
        x_in, w_in, out2 if weight_scale is None else weight_scale, bias_in, out2, partials,
        counters, m, n, k, k_per_split, x2.stride(0), weight.stride(0), out2.stride(0),
        M_PAD=pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, METHOD=METHODS[method],
        EVEN_K=k % cfg.block_k == 0, HAS_SCALE=fp8, HAS_BIAS=bias is not None, REDUCE=mode,
        W_AHEAD=method == "fma" and cfg.w_ahead, VEC_K=cfg.vec_k or 16 // weight.element_size(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(x),
    )  # fmt: skip
    if mode in (REDUCE_MODES["kernel"], REDUCE_MODES["atomic"]):
        skinny_reduce_kernel[(-(-n // _REDUCE_BLOCK), m)](
            partials, bias_in, out2, m, n, partials.shape[0], out2.stride(0),
            HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK, num_warps=4, **pdl_launch(x),
        )  # fmt: skip
    return out


def skinny_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: F.linear in float32 (W dequantized when FP8), rounded once to x's
    dtype."""
    fp32_bias = bias.float() if bias is not None else None
    w = weight.float() if weight_scale is None else weight.float() * weight_scale[:, None]
    y = torch.nn.functional.linear(x.float(), w, fp32_bias)
    return y.to(x.dtype)
