"""Correctness of `paged_attention` at real sizes on the GPU, for kernels_attention.py --check:
decode, long bounds, prefill, mixed batches, speculative-decode rows and a sliding window, each
read through the block table and with the chunk's keys from fused QKV rows, against the torch
reference."""

from __future__ import annotations

import torch
from kernels_attention import SCALE, build_batch, with_fused_qkv

from inferengine.kernels import paged_attention as pa


def check_cases(block_size: int) -> list[tuple[str, list[int], list[int], dict]]:
    g = torch.Generator().manual_seed(block_size)
    rand = lambda n, lo, hi: torch.randint(lo, hi + 1, (n,), generator=g).tolist()  # noqa: E731
    return [
        ("decode", [1] * 32, [1, 8192, *rand(30, 2, 8192)], {}),
        ("decode-b1-32k-bound", [1], [8000], {"max_seq_len": 32768}),
        ("prefill", [1, 300, 2048], [1, 300, 2048], {}),
        ("mixed", [1] * 24 + [512, 100, 777], [*rand(24, 1, 8192), 4608, 3000, 777], {}),
        ("mixed-bounds", [1] * 8 + [300], [*rand(8, 1, 8192), 5000], {"max_query_len": 2048}),
        ("spec-decode", [4] * 16, rand(16, 4, 8192), {}),
        ("window-4096", [1, 1, 600], [7000, 300, 6000], {"sliding_window": 4096}),
    ]


def compare(name: str, block_size: int, dtype: torch.dtype, got, want) -> dict:
    tol = 2e-5 if dtype == torch.float32 else 4e-3 if dtype == torch.float16 else 2e-2
    err = ((got.float() - want.float()).abs() - tol * want.float().abs()).max().item()
    ok = bool(err <= tol) and not got.isnan().any().item()
    print(f"check {name} bs={block_size} {dtype}: {'ok' if ok else 'FAIL'} ({err:.2e})")
    return {"case": name, "block_size": block_size, "dtype": str(dtype), "excess_error": err,
            "ok": ok}  # fmt: skip


def run_checks(block_sizes: list[int], dtypes: list[torch.dtype]) -> list[dict]:
    results = []
    for block_size in block_sizes:
        for name, q_lens, seq_lens, kw in check_cases(block_size):
            for dtype in dtypes:
                batch = build_batch(q_lens, seq_lens, block_size, dtype)
                window = kw.get("sliding_window")
                got = pa.paged_attention(
                    *batch.args(), max_query_len=kw.get("max_query_len", max(q_lens)),
                    max_seq_len=kw.get("max_seq_len", max(seq_lens)), scale=SCALE,
                    sliding_window=window,
                )  # fmt: skip
                want = pa.paged_attention_ref(*batch.args(), scale=SCALE, sliding_window=window)
                results.append(compare(name, block_size, dtype, got, want))
                fused, fresh = with_fused_qkv(batch)
                got = pa.paged_attention(
                    *fused.args(), max_query_len=kw.get("max_query_len", max(q_lens)),
                    max_seq_len=kw.get("max_seq_len", max(seq_lens)), scale=SCALE,
                    sliding_window=window, **fresh,
                )  # fmt: skip
                results.append(compare(name + " fresh-kv", block_size, dtype, got, want))
                del batch, got, want
    return results
