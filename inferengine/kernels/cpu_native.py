"""Our C++ CPU kernels (`kernels/csrc/`): compiled once per machine, loaded as torch ops.

They are built on first use with torch's extension builder (a C++17 compiler and ninja) for
this CPU's instruction sets (`-march=native`; x86-64 with AVX2, FMA and F16C at least), cached
as `$INFERENGINE_CACHE_DIR/cpu_kernels/<name>.so`, and registered as
`torch.ops.inferengine_cpu.*`. Where they cannot be built, `native_ops()` says why and every
caller keeps its torch path.

`qlinear_q4` / `qlinear_q8` multiply by block-quantized weights (GGUF's Q4_0, Q4_1, Q4_K, Q8_0
and Q5_0 exactly) with the activations quantized per block of 32 into int8 terms; `pack_q4` /
`pack_q8` lay the weights out as the kernels read them, and `qlinear_reference` is the same
arithmetic in torch, for tests. `decode_attention`, `rms_norm` and `silu_and_mul` are checked
against their torch paths in `tests/kernels/test_cpu_native.py`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from inferengine import envs
from inferengine.logger import init_logger

logger = init_logger(__name__)

BLOCK = 32  # input features per weight (and activation) scale
TILE = 8  # output rows per packed weight tile (one per int32 lane)
# Activations go to the kernels as two int8 terms per block (about 15 bits): one term (8 bits,
# llama.cpp's choice) moves SmolLM2's logits by up to 0.3 nats and flips its near-ties.
ACTIVATION_TERMS = 2
_SOURCES = ("qgemm.cpp", "decode_attention.cpp", "elementwise.cpp")
_REQUIRED_FLAGS = frozenset({"avx2", "fma", "f16c"})
# Compiler flags beside -march=native per INFERENGINE_CPU_KERNELS mode: "avx2" builds the path
# of CPUs without AVX-512 (16 vector registers, no dpbusd) on one that has it, to test it.
_MODE_FLAGS = {"native": [], "avx2": ["-mno-avx512f", "-mno-avxvnni"]}
_unavailable_reason: str | None = None


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first core's feature flags (`flags` on x86, `Features` on Arm); empty if unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _source_dir() -> Path:
    return Path(__file__).resolve().parent / "csrc"


def _build_name(sources: list[Path], flags: list[str]) -> str:
    """An extension name unique to the sources, the flags and this CPU's instruction set, so a
    cache shared between machines never loads a build for another CPU."""
    digest = hashlib.sha256(" ".join(flags).encode())
    for path in sources:
        digest.update(path.read_bytes())
    isa = sorted(f for f in cpu_flags() if f.startswith(("avx", "f16c", "fma", "amx")))
    digest.update(" ".join(isa).encode())
    digest.update(torch.__version__.encode())
    return f"inferengine_cpu_{digest.hexdigest()[:16]}"


def cpu_ops(x: torch.Tensor) -> Any | None:
    """The kernels for a CPU tensor of a dtype they take (float32, bfloat16), else None."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return native_ops()


@functools.cache
def native_ops() -> Any | None:
    """`torch.ops.inferengine_cpu`, built and loaded on first call; None where it cannot be
    (`unavailable_reason()` says why, logged once)."""
    global _unavailable_reason
    import platform

    mode = envs.cpu_kernels()
    if mode == "off":
        _unavailable_reason = "INFERENGINE_CPU_KERNELS=0"
        logger.info("CPU kernels off (INFERENGINE_CPU_KERNELS=0): torch ops instead")
        return None
    if mode not in _MODE_FLAGS:
        _unavailable_reason = f"INFERENGINE_CPU_KERNELS={mode!r} is not 1, 0 or avx2"
        logger.warning("CPU kernels unavailable: %s", _unavailable_reason)
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        _unavailable_reason = f"they are written for x86-64, this is {platform.machine()}"
    elif not cpu_flags() >= _REQUIRED_FLAGS:
        missing = ", ".join(sorted(_REQUIRED_FLAGS - cpu_flags()))
        _unavailable_reason = f"this CPU lacks {missing}"
    else:
        try:
            _build_and_load(_MODE_FLAGS[mode])
            return torch.ops.inferengine_cpu
        except Exception as e:  # a missing compiler or ninja, a failed build
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            _unavailable_reason = f"building them failed ({type(e).__name__}: {first_line[:300]})"
    logger.warning("CPU kernels unavailable, using torch ops instead: %s", _unavailable_reason)
    return None


def unavailable_reason() -> str | None:
    return _unavailable_reason


def _build_and_load(flags: list[str]) -> None:
    """Load the cached library, or build it in a folder of this process's own and move it
    into the cache: a build that is killed half-way leaves no lock for the next start to wait
    on forever (torch's builder locks its build folder), and processes building at once each
    finish (the move is atomic)."""
    from torch.utils import cpp_extension

    sources = [_source_dir() / name for name in _SOURCES]
    name = _build_name([*sources, _source_dir() / "simd.h"], flags)
    cache = envs.cache_dir() / "cpu_kernels"
    library = cache / f"{name}.so"
    start = time.perf_counter()
    built = not library.exists()
    if built:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f"{name}-", dir=cache) as build_dir:
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in sources],
                build_directory=build_dir,
                extra_cflags=["-O3", "-march=native", *flags, "-std=c++17", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            os.replace(Path(build_dir) / f"{name}.so", library)
    else:
        torch.ops.load_library(str(library))
    logger.info(
        "CPU kernels (%s) %s in %.1f s",
        torch.ops.inferengine_cpu.isa(),
        "built" if built else "loaded",
        time.perf_counter() - start,
    )


def _padded_rows(n: int) -> int:
    return -(-n // TILE) * TILE


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    extra = rows - t.shape[0]
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def _scale_tiles(scale: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[N, B] → [N/8, B, 8]: a block's scales of a tile's rows side by side."""
    scale = _pad_rows(scale, rows).to(dtype)
    return scale.view(rows // TILE, TILE, -1).transpose(1, 2).contiguous()


def _scale_dtype(*scales: torch.Tensor) -> torch.dtype:
    """float16 where every scale is exactly one (GGUF's Q4_0, Q4_1, Q8_0 store them so), float32
    otherwise (Q4_K's products of a float16 and a 6-bit integer)."""
    for s in scales:
        if not torch.equal(s.to(torch.float16).float(), s.float()):
            return torch.float32
    return torch.float16


def pack_q4(
    u: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights w = scale · u + offset (u uint8 [N, K] in 0..15; scale, offset [N, K/32]) as
    `qlinear_q4` takes them: (values [N/8, K/32, 128], scales, offsets [N/8, K/32, 8]); N is
    padded to a multiple of 8 with zero rows."""
    n, k = u.shape
    if k % BLOCK or scale.shape != (n, k // BLOCK) or offset.shape != scale.shape:
        raise ValueError(f"q4 weights need K a multiple of {BLOCK}: {tuple(u.shape)}")
    rows, blocks = _padded_rows(n), k // BLOCK
    # [tile, row, block, group pair, low/high, 4 inputs]
    groups = _pad_rows(u, rows).to(torch.uint8).view(rows // TILE, TILE, blocks, 4, 2, 4)
    packed = groups[:, :, :, :, 0] | (groups[:, :, :, :, 1] << 4)
    packed = packed.permute(0, 2, 3, 1, 4).reshape(rows // TILE, blocks, 128).contiguous()
    dtype = _scale_dtype(scale, offset)
    return packed, _scale_tiles(scale, rows, dtype), _scale_tiles(offset, rows, dtype)


def pack_q8(
    q: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights w = scale · q (q int8 [N, K] in -127..127, scale [N, K/32]) as `qlinear_q8`
    takes them: (values [N/8, K/32, 256], −128 · Σ q per block int32 [N/8, K/32, 8], scales
    [N/8, K/32, 8]); N is padded to a multiple of 8 with zero rows. A −128 (which
    llama.cpp's quantizer never writes) is refused: the kernel may move signs between operands."""
    n, k = q.shape
    if k % BLOCK or scale.shape != (n, k // BLOCK):
        raise ValueError(f"q8 weights need K a multiple of {BLOCK}: {tuple(q.shape)}")
    if bool((q == -128).any()):
        raise ValueError("q8 weights must lie in -127..127")
    rows, blocks = _padded_rows(n), k // BLOCK
    tiles = _pad_rows(q, rows).to(torch.int8).view(rows // TILE, TILE, blocks, 8, 4)
    packed = tiles.permute(0, 2, 3, 1, 4).reshape(rows // TILE, blocks, 256).contiguous()
    sums = tiles.sum(dim=(3, 4))  # [tile, row, block]
    corr = (-128 * sums).to(torch.int32).transpose(1, 2).contiguous()
    return packed, corr, _scale_tiles(scale, rows, _scale_dtype(scale))


def _untile_scales(t: torch.Tensor) -> torch.Tensor:
    """[N/8, B, 8] → [N, B] float32."""
    return t.float().transpose(1, 2).reshape(-1, t.shape[1])


def quantize_blocks_reference(
    x: torch.Tensor, terms: int = ACTIVATION_TERMS
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (x_t int8 [M, terms, K], d_t float32 [M, terms, K/32]) as the kernels
    quantize it, x ≈ Σ_t d_t · x_t per block: d = max|v| / 127, x_t = round(v · (1 / d)) with
    ties to even, and v = x, then what the terms before left of it."""
    m, k = x.shape
    v = x.float().view(m, k // BLOCK, BLOCK)
    values, scales = [], []
    for _ in range(terms):
        d = v.abs().amax(dim=-1) / 127.0
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(v * inv.unsqueeze(-1))
        values.append(q.to(torch.int8).view(m, k))
        scales.append(d)
        # v − q · d rounded once, as the kernel's fused multiply-add does
        v = (v.double() - q.double() * d.double().unsqueeze(-1)).float()
    return torch.stack(values, dim=1), torch.stack(scales, dim=1)


def qlinear_reference(
    x: torch.Tensor, w: torch.Tensor, terms: int = ACTIVATION_TERMS
) -> torch.Tensor:
    """What the kernels compute for a dequantized weight w [N, K]: x quantized per block,
    products in float64 (the kernels' integer sums are exact; only their float32 sums of
    blocks differ, in the last bits)."""
    q, d = quantize_blocks_reference(x, terms)
    m, _, k = q.shape
    parts = q.double().view(m, terms, k // BLOCK, BLOCK) * d.double().unsqueeze(-1)
    return (parts.sum(dim=1).view(m, k) @ w.double().t()).to(x.dtype)


def dequantize_q4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of `pack_q4`'s output (padded rows included)."""
    tiles, blocks = packed.shape[:2]
    raw = packed.view(tiles, blocks, 4, 1, TILE, 4)  # [tile, block, pair, 1, row, input]
    u = torch.cat([raw & 0x0F, raw >> 4], dim=3).permute(0, 4, 1, 2, 3, 5)
    u = u.reshape(tiles * TILE, blocks, BLOCK).float()
    s, o = _untile_scales(scale), _untile_scales(offset)
    return (u * s.unsqueeze(-1) + o.unsqueeze(-1)).flatten(1)


def dequantize_q8(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] of `pack_q8`'s output (padded rows included)."""
    tiles, blocks = packed.shape[:2]
    q = packed.view(tiles, blocks, 8, TILE, 4).permute(0, 3, 1, 2, 4)
    q = q.reshape(tiles * TILE, blocks, BLOCK).float()
    return (q * _untile_scales(scale).unsqueeze(-1)).flatten(1)
