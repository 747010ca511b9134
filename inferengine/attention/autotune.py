"""`--attention-backend-benchmark`: time the usable backends on the model's attention shape at
start-up and keep the fastest, remembered on disk per device, torch version and shape.

Each candidate runs the same two synthetic steps on a scratch page pool: a decode batch and a
prefill chunk (the two kinds of work a serving step mixes). A candidate that fails is logged and
left out; the torch reference always runs, so there is always a choice.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inferengine.attention.backends.base import AttentionBackend, AttentionSpec
from inferengine.attention.metadata import AttentionMetadata
from inferengine.logger import init_logger

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

    def key(self, device: torch.device) -> str:
        if device.type == "cuda":
            where = torch.cuda.get_device_name(device)
        else:
            where = device.type
        return (
            f"{where}|torch {torch.__version__}|{str(self.dtype).removeprefix('torch.')}|"
            f"heads {self.num_heads}/{self.num_kv_heads}x{self.head_dim}|"
            f"page {self.block_size}|window {self.sliding_window}"
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
        cache.to(**as_device),
        metadata,
    )


def time_backend(
    backend: AttentionBackend, shape: AttentionShape, workload: Workload, device: torch.device
) -> float:
    """Milliseconds for the workload's decode step plus its prefill chunk (best of repeats)."""
    spec = AttentionSpec(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim**-0.5,
        shape.sliding_window,
    )  # fmt: skip
    b, ctx, chunk = workload.decode_batch, workload.decode_context, workload.prefill_tokens
    steps = [_step(shape, [1] * b, [ctx] * b, device), _step(shape, [chunk], [chunk], device)]

    def run() -> None:
        for q, k, v, cache, metadata in steps:
            backend.forward(spec, q, k, v, cache, metadata)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        run()  # warm-up: compilation, autotuning
        sync()
        best = float("inf")
        for _ in range(workload.repeats):
            start = time.perf_counter()
            run()
            sync()
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def choose_backend(
    shape: AttentionShape,
    device: torch.device,
    candidates: dict[str, Callable[[], AttentionBackend]],
    cache_dir: Path,
    workload: Workload | None = None,
) -> Choice:
    """The fastest candidate for this device and shape, from the disk cache when it has one."""
    path = cache_dir / CACHE_FILE
    key = shape.key(device)
    known = _read(path)
    entry = known.get(key)
    if entry and entry.get("backend") in candidates:
        logger.info("attention backend %s (benchmarked before: %s)", entry["backend"], path)
        return Choice(entry["backend"], entry.get("timings_ms", {}), cached=True)
    workload = workload or Workload.for_device(device)
    timings: dict[str, float] = {}
    for name, make in candidates.items():
        try:
            timings[name] = round(time_backend(make(), shape, workload, device), 4)
        except Exception as e:  # a backend that cannot run this shape is simply not chosen
            logger.warning(
                "attention backend %s failed its benchmark: %s: %s", name, type(e).__name__, e
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
    known[key] = {"backend": best, "timings_ms": timings, "workload": asdict(workload)}
    _write(path, known)
    return Choice(best, timings)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict) -> None:
    """Write atomically, so two engines starting together never leave half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as e:
        logger.warning("could not cache the attention benchmark in %s: %s", path, e)
