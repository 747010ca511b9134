"""`--attention-backend-benchmark`: time the usable backends on the model's attention shape at
start-up and keep the fastest, remembered on disk per device, torch version and shape.

Each candidate runs the same two synthetic steps on a scratch page pool: a decode batch and a
prefill chunk (the two kinds of work a serving step mixes), eagerly. A candidate that fails, or
whose output differs from the torch reference's, is logged and left out; the torch reference
always runs, so there is always a choice.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inferengine.attention.backends.base import AttentionBackend, AttentionSpec
from inferengine.attention.metadata import AttentionMetadata
from inferengine.kernels.kv_quant import quantize
from inferengine.logger import init_logger
from inferengine.version import __version__

logger = init_logger(__name__)

CACHE_FILE = "attention_backends.json"


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    sliding_window: int | None = None
    kv_cache_dtype: torch.dtype | None = None  # None: `dtype`

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    def key(self, device: torch.device) -> str:
        if device.type == "cuda":
            where = torch.cuda.get_device_name(device)
        else:
            where = device.type
        kv = "" if self.cache_dtype == self.dtype else f"|kv {self.cache_dtype}"
        return (
            f"{where}|torch {torch.__version__}|{str(self.dtype).removeprefix('torch.')}|"
            f"heads {self.num_heads}/{self.num_kv_heads}x{self.head_dim}|"
            f"page {self.block_size}|window {self.sliding_window}{kv}"
        )


@dataclass(frozen=True)
class Workload:
    """The synthetic steps timed: `decode_batch` sequences of `decode_context` tokens each
    decoding one token, and one prefill chunk of `prefill_tokens`."""

    decode_batch: int
    decode_context: int
    prefill_tokens: int
    repeats: int

    @classmethod
    def for_device(cls, device: torch.device) -> Workload:
        if device.type == "cuda":
            return cls(decode_batch=32, decode_context=2048, prefill_tokens=2048, repeats=10)
        return cls(decode_batch=4, decode_context=128, prefill_tokens=64, repeats=2)


@dataclass
class Choice:
    backend: str
    timings_ms: dict[str, float]  # candidate -> ms for the workload; failures absent
    cached: bool = False


def _step(
    shape: AttentionShape, q_lens: list[int], seq_lens: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    bs = shape.block_size
    blocks = [-(-n // bs) for n in seq_lens]
    width = max(blocks)
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    slots: list[int] = []
    next_page = 1
    for i, (q_len, n) in enumerate(zip(q_lens, seq_lens, strict=True)):
        table[i, : blocks[i]] = torch.arange(next_page, next_page + blocks[i])
        next_page += blocks[i]
        slots += [int(table[i, p // bs]) * bs + p % bs for p in range(n - q_len, n)]
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, next_page, bs, shape.num_kv_heads, shape.head_dim, generator=g)
    tokens = starts[-1]
    q = torch.randn(tokens, shape.num_heads, shape.head_dim, generator=g)
    kv = torch.randn(2, tokens, shape.num_kv_heads, shape.head_dim, generator=g)
    metadata = AttentionMetadata(
        num_actual_tokens=tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=starts,
        seq_lens_cpu=list(seq_lens),
    )
    as_device = dict(device=device, dtype=shape.dtype)
    return (
        q.to(**as_device),
        kv[0].to(**as_device),
        kv[1].to(**as_device),
        quantize(cache, 1.0, shape.cache_dtype).to(device),
        metadata,
    )


TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def _workload_steps(shape: AttentionShape, workload: Workload, device: torch.device) -> list:
    """The decode batch and the prefill chunk of `workload`, as backend inputs."""
    b, ctx, chunk = workload.decode_batch, workload.decode_context, workload.prefill_tokens
    return [_step(shape, [1] * b, [ctx] * b, device), _step(shape, [chunk], [chunk], device)]


def _spec(shape: AttentionShape) -> AttentionSpec:
    return AttentionSpec(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim**-0.5,
        shape.sliding_window,
    )  # fmt: skip


def _run(backend: AttentionBackend, shape: AttentionShape, steps: list) -> list[torch.Tensor]:
    spec = _spec(shape)
    return [backend.forward(spec, q, k, v, cache, md) for q, k, v, cache, md in steps]


def _check(name: str, outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> None:
    """Raise if a candidate's output is not the reference's within its dtype's tolerance."""
    for out, ref in zip(outputs, reference, strict=True):
        tol = TOLERANCE.get(ref.dtype, 1e-3)
        if not torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol):
            error = (out.float() - ref.float()).abs().max().item()
            raise ValueError(f"{name} differs from the torch reference (max error {error:.3g})")


def time_backend(
    backend: AttentionBackend,
    shape: AttentionShape,
    workload: Workload,
    device: torch.device,
    reference: list[torch.Tensor] | None = None,
) -> float:
    """Milliseconds for the workload's decode step plus its prefill chunk (best of repeats),
    after checking the outputs against `reference` (the torch backend's, when given)."""
    steps = _workload_steps(shape, workload, device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        outputs = _run(backend, shape, steps)  # also the warm-up: compilation, autotuning
        if reference is not None:
            _check(backend.name, outputs, reference)
        sync()
        best = float("inf")
        for _ in range(workload.repeats):
            start = time.perf_counter()
            _run(backend, shape, steps)
            sync()
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def reference_outputs(
    shape: AttentionShape, workload: Workload, device: torch.device
) -> list[torch.Tensor]:
    from inferengine.attention.backends.torch_ref import TorchAttentionBackend

    steps = _workload_steps(shape, workload, device)
    with torch.inference_mode():
        return _run(TorchAttentionBackend(), shape, steps)


def choose_backend(
    shape: AttentionShape,
    device: torch.device,
    candidates: dict[str, Callable[[], AttentionBackend]],
    cache_dir: Path,
    workload: Workload | None = None,
) -> Choice:
    """The fastest candidate that computes what the torch reference computes, for this device
    and shape; from the disk cache when the same candidates were timed there before."""
    path = cache_dir / CACHE_FILE
    key = f"{shape.key(device)}|{versions()}|candidates {','.join(sorted(candidates))}"
    entry = _read(path).get(key)
    if isinstance(entry, dict) and entry.get("backend") in candidates:
        logger.info("attention backend %s (benchmarked before: %s)", entry["backend"], path)
        return Choice(entry["backend"], dict(entry.get("timings_ms") or {}), cached=True)
    workload = workload or Workload.for_device(device)
    reference = reference_outputs(shape, workload, device)
    timings: dict[str, float] = {}
    for name, make in candidates.items():
        try:
            timings[name] = round(time_backend(make(), shape, workload, device, reference), 4)
        except Exception as e:  # a backend that cannot run this shape is simply not chosen
            logger.warning(
                "attention backend %s left out of the benchmark: %s: %s", name, type(e).__name__, e
            )
    if not timings:
        raise RuntimeError("no attention backend ran the benchmark; see the warnings above")
    best = min(timings, key=timings.__getitem__)
    logger.info(
        "attention benchmark (%s): %s -> %s",
        asdict(workload),
        ", ".join(f"{n} {t:.3f} ms" for n, t in timings.items()),
        best,
    )
    _update(path, key, {"backend": best, "timings_ms": timings, "workload": asdict(workload)})
    return Choice(best, timings)


def versions() -> str:
    """What the timings depend on besides the device and shape."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"inferengine {__version__}|triton {triton_version}"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _update(path: Path, key: str, entry: dict) -> None:
    """Add one entry, re-reading the file just before an atomic replace so that engines starting
    together lose at most a timing, never the file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = entry
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the attention benchmark in %s: %s", path, e)
