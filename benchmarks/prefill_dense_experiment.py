"""Experiment: how fast can a Triton causal prefill kernel be on this GPU when a chunk's keys are
read from the step's contiguous K/V (the fused QKV output) instead of through the block table?

Times a FlashAttention-layout kernel (one query head per program, BLOCK_M tokens) with pointer
loads and with TMA descriptor loads, beside our paged kernel and torch SDPA, at chunk 2k for
batch 1 and 4 (Qwen2.5-7B heads), and checks each against SDPA. Writes a result folder.

    python benchmarks/prefill_dense_experiment.py [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_attention import (
    HKV,
    HQ,
    SCALE,
    D,
    build_batch,
    ours,
    reference_rates,
    time_ms,
    with_fused_qkv,
)  # fmt: skip
from result_folder import write_result_folder

from inferengine.kernels.attention_kernels import _find_seq, paged_attention_kernel

LOG2E = 1.4426950408889634


@triton.jit
def _step(acc, l_i, m_i, q, k, v, qk_scale, offs_m, pos_n, MASKED: tl.constexpr):
    qk = tl.dot(q, tl.trans(k))
    if MASKED:
        qk = qk * qk_scale + tl.where(offs_m[:, None] >= pos_n[None, :], 0.0, -1.0e6)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_new[:, None]
    p = tl.exp2(qk)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _load_kv(k_in, v_in, q_start, start_n, kvh, stride_kt, offs_n, offs_d, HEAD_DIM: tl.constexpr,
             TMA: tl.constexpr):  # fmt: skip
    if TMA:
        k = k_in.load([q_start + start_n, kvh * HEAD_DIM])
        v = v_in.load([q_start + start_n, kvh * HEAD_DIM])
    else:
        kr = (q_start + start_n + offs_n).to(tl.int64)[:, None] * stride_kt
        k = tl.load(k_in + kr + kvh * HEAD_DIM + offs_d[None, :])
        v = tl.load(v_in + kr + kvh * HEAD_DIM + offs_d[None, :])
    return k, v


@triton.jit
def dense_prefill_kernel(
    q_in, k_in, v_in, out_ptr, qsl_ptr, num_seqs, qk_scale,
    stride_qt, stride_kt, stride_ot,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr,
):  # fmt: skip
    """Grid (query heads, query tiles): causal attention of BLOCK_M query tokens of one head over
    their own sequence's keys (no earlier context), last tile of a sequence first."""
    qh = tl.program_id(0)
    pid = tl.program_id(1)
    seq = _find_seq(qsl_ptr, num_seqs, pid, BLOCK_M)
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    q_len = q_end - q_start
    m_tile = q_end // BLOCK_M + seq - pid
    if m_tile * BLOCK_M >= q_len:
        return
    kvh = qh // GROUP
    start_m = m_tile * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    if TMA:
        q = q_in.load([q_start + start_m, qh * HEAD_DIM])
    else:
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_in + rows[:, None] * stride_qt + qh * HEAD_DIM + offs_d[None, :])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, q_len)
    # Keys before the tile's first query are visible to all its rows: no mask, no branch.
    for start_n in tl.range(0, start_m, BLOCK_N, warp_specialize=WS):
        k, v = _load_kv(k_in, v_in, q_start, start_n, kvh, stride_kt, offs_n, offs_d, HEAD_DIM, TMA)
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k, v, qk_scale, offs_m, start_n + offs_n, False)
    for start_n in range(start_m, hi, BLOCK_N):
        k, v = _load_kv(k_in, v_in, q_start, start_n, kvh, stride_kt, offs_n, offs_d, HEAD_DIM, TMA)
        acc, l_i, m_i = _step(acc, l_i, m_i, q, k, v, qk_scale, offs_m, start_n + offs_n, True)
    out = acc / l_i[:, None]
    rows = (q_start + offs_m).to(tl.int64)
    o_ptrs = out_ptr + rows[:, None] * stride_ot + qh * HEAD_DIM + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=(offs_m < q_len)[:, None])


def compiled_resources(jit_fn) -> list[dict]:
    """Registers, spills and shared memory of every variant of `jit_fn` compiled so far: what
    decides how many programs share an SM."""
    out = []
    for cache in jit_fn.device_caches.values():
        for kernel in cache[0].values():
            kernel._init_handles()
            out.append(
                {
                    "regs": kernel.n_regs,
                    "spills": kernel.n_spills,
                    "shared_bytes": kernel.metadata.shared,
                    "num_warps": kernel.metadata.num_warps,
                    "num_stages": kernel.metadata.num_stages,
                    "constants": str(kernel.src.constants)[:400] if hasattr(kernel, "src") else "",
                }
            )
    return out


def dense_call(q2, k2, v2, out2, qsl, num_seqs, cfg, tma: bool, ws: bool = False):
    bm, bn, warps, stages = cfg
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        q_in = TensorDescriptor.from_tensor(q2, [bm, D])
        k_in = TensorDescriptor.from_tensor(k2, [bn, D])
        v_in = TensorDescriptor.from_tensor(v2, [bn, D])
    else:
        q_in, k_in, v_in = q2, k2, v2
    grid = (HQ, q2.shape[0] // bm + num_seqs)
    return lambda: dense_prefill_kernel[grid](
        q_in, k_in, v_in, out2, qsl, num_seqs, SCALE * LOG2E,
        q2.stride(0), k2.stride(0), out2.stride(0),
        GROUP=HQ // HKV, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, TMA=tma, WS=ws,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip


# (BLOCK_M, BLOCK_N, warps, stages, warp-specialized loop); TMA loads (ahead in the first runs)
CONFIGS = [(64, 64, 4, 3, False), (64, 64, 4, 2, False), (64, 128, 4, 2, False),
           (128, 128, 8, 3, False), (128, 64, 8, 3, False), (64, 64, 4, 3, True),
           (64, 64, 4, 2, True), (128, 128, 8, 3, True), (128, 64, 8, 3, True)]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the best config, with and without warp specialization",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    results: dict = {"configs": CONFIGS, "rows": []}
    try:
        rates = reference_rates(args.repeats)
        results["reference"] = rates
        for b, chunk in ((1, 2048), (4, 2048)):
            flops = 4 * D * HQ * b * chunk * (chunk + 1) // 2
            batch = build_batch([chunk] * b, [chunk] * b, 16)
            t = b * chunk
            # A fused-QKV-like buffer: q | k | v per token row, as the model's projection gives.
            # Spare finite rows past the end: pointer loads of a last partial tile read them.
            qkv = torch.randn(t + 256, (HQ + 2 * HKV) * D, dtype=torch.bfloat16, device="cuda")
            q2, k2, v2 = qkv[:t].split([HQ * D, HKV * D, HKV * D], dim=1)
            q4 = q2.view(b, chunk, HQ, D).transpose(1, 2)
            k4 = k2.reshape(b, chunk, HKV, D).transpose(1, 2)
            v4 = v2.reshape(b, chunk, HKV, D).transpose(1, 2)
            want = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=SCALE,
                                                  enable_gqa=True).transpose(1, 2).reshape(t, HQ * D)  # fmt: skip
            row = {"batch": b, "chunk": chunk}
            ms, _ = time_ms(ours(batch, chunk, chunk), args.repeats)
            row["paged_TFLOPs"] = flops / ms / 1e9
            # As the engine calls it: the chunk's own keys from the fused QKV rows (TMA).
            fused, fresh = with_fused_qkv(batch)
            call = ours(fused, chunk, chunk, min_query_len=chunk, **fresh)
            ms, _ = time_ms(call, args.repeats)
            row["ours_TFLOPs"] = flops / ms / 1e9
            del fused, fresh
            sdpa = partial(
                F.scaled_dot_product_attention, q4, k4, v4, is_causal=True, scale=SCALE,
                enable_gqa=True,
            )  # fmt: skip
            ms, _ = time_ms(sdpa, args.repeats)
            row["sdpa_TFLOPs"] = flops / ms / 1e9
            for tma in (True,):
                for *cfg, ws in CONFIGS if not args.quick else [CONFIGS[0], CONFIGS[5]]:
                    key = f"{'tma' if tma else 'ptr'} {tuple(cfg)}{' ws' if ws else ''}"
                    out2 = torch.full(
                        (t, HQ * D), float("nan"), dtype=torch.bfloat16, device="cuda"
                    )
                    try:
                        call = dense_call(q2, k2, v2, out2, batch.query_start_loc, b, cfg, tma, ws)
                        call()
                        err = (out2.float() - want.float()).abs().max().item()
                        ms, _ = time_ms(call, args.repeats)
                        row[key] = {"TFLOPs": flops / ms / 1e9, "max_abs_err": err}
                    except Exception as e:  # a config that does not compile is recorded
                        row[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                    print(key, b, row[key], flush=True)
            results["rows"].append(row)
            print({k: v for k, v in row.items() if "TFLOPs" in k}, flush=True)
        results["resources"] = {
            "paged_attention_kernel": compiled_resources(paged_attention_kernel),
            "dense_prefill_kernel": compiled_resources(dense_prefill_kernel),
        }
        for name, variants in results["resources"].items():
            for v in variants:
                print(name, {k: v[k] for k in ("regs", "spills", "shared_bytes", "num_warps")})
    except Exception:
        results["error"] = traceback.format_exc()
        print(results["error"])
    folder = write_result_folder("prefill-dense-experiment", results, root=args.out_dir)
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
