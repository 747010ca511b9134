"""Tiny AWQ, GPTQ and compressed-tensors checkpoints made from a float one: round-to-nearest
quantization per group, each format's packing and reference dequantization written here from
the formats' definitions (not with the engine's code), beside a float32 copy holding exactly
the weights the quantized one decodes to."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@dataclass(frozen=True)
class Scheme:
    method: str  # awq, gptq, compressed-tensors
    bits: int = 4
    group_size: int = 128
    sym: bool = False
    desc_act: bool = False
    version: str = "gptq"  # GPTQ's checkpoint_format: gptq (zeros stored - 1) or gptq_v2


@dataclass
class Quantized:
    """w ≈ (q - zeros[g_idx]) * scales[g_idx] with q [N, K] unsigned, scales/zeros [N, G]."""

    q: torch.Tensor
    scales: torch.Tensor  # float16
    zeros: torch.Tensor
    g_idx: torch.Tensor  # [K] int32

    def dequantize(self) -> torch.Tensor:
        g = self.g_idx.long()
        return (self.q.float() - self.zeros[:, g].float()) * self.scales[:, g].float()


def rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool, g_idx=None) -> Quantized:
    """Round-to-nearest per group (groups from `g_idx`, else consecutive columns)."""
    n, k = w.shape
    w = w.float()
    if g_idx is None:
        size = k if group_size == -1 else group_size
        g_idx = torch.arange(k, dtype=torch.int32) // size
    groups = int(g_idx.max()) + 1
    maxq = (1 << bits) - 1
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale = cols.abs().amax(dim=1).clamp(min=1e-5) / ((maxq - 1) / 2)
            zero = torch.full((n,), float((maxq + 1) // 2))
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale = ((hi - lo) / maxq).clamp(min=1e-5)
            # GPTQ v1 stores zero - 1 packed: a zero of 0 cannot be written, so keep it >= 1.
            zero = torch.round(-lo / scale).clamp(1, maxq)
        scales[:, g], zeros[:, g] = scale.half().float(), zero
    scales16 = scales.half()
    q = torch.round(w / scales[:, g_idx.long()] + zeros[:, g_idx.long()]).clamp(0, maxq)
    return Quantized(q.to(torch.int64), scales16, zeros.to(torch.int64), g_idx)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 as the int32 a checkpoint stores (two's complement)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along(values: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """Words of 32 / bits values along `dim`; value i of a word at bits [i*bits, (i+1)*bits),
    taken from position `order[i]` of its run (sequential without `order`)."""
    per = 32 // bits
    values = values.movedim(dim, -1).to(torch.int64)
    runs = values.reshape(*values.shape[:-1], -1, per)
    words = torch.zeros(runs.shape[:-1], dtype=torch.int64)
    for i in range(per):
        words |= runs[..., order[i] if order else i] << (bits * i)
    return to_int32(words).movedim(-1, dim)


def unpack_along(words: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    per = 32 // bits
    words = words.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros(*words.shape, per, dtype=torch.int64)
    for i in range(per):
        out[..., order[i] if order else i] = (words >> (bits * i)) & ((1 << bits) - 1)
    return out.reshape(*words.shape[:-1], -1).movedim(-1, dim)


def pack(scheme: Scheme, qz: Quantized) -> dict[str, torch.Tensor]:
    """One layer's tensors in `scheme`'s checkpoint layout (suffix -> tensor)."""
    b = scheme.bits
    if scheme.method == "awq":  # [K, N/8] interleaved along N
        return {
            "qweight": pack_along(qz.q.t(), 4, 1, AWQ_ORDER),
            "qzeros": pack_along(qz.zeros.t(), 4, 1, AWQ_ORDER),
            "scales": qz.scales.t().contiguous(),
        }
    if scheme.method == "gptq":  # [K/p, N] along K; zeros [G, N/p] along N, v1 minus one
        offset = 1 if scheme.version == "gptq" else 0
        return {
            "qweight": pack_along(qz.q.t(), b, 0),
            "qzeros": pack_along(qz.zeros.t() - offset, b, 1),
            "scales": qz.scales.t().contiguous(),
            "g_idx": qz.g_idx.clone(),
        }
    tensors = {  # compressed-tensors: [N, K/p] along K, values + 2^(b-1) (stored unsigned)
        "weight_packed": pack_along(qz.q, b, 1),
        "weight_scale": qz.scales.clone(),
        "weight_shape": torch.tensor(list(qz.q.shape), dtype=torch.int64),
    }
    if scheme.desc_act:
        tensors["weight_g_idx"] = qz.g_idx.clone()
    return tensors


def reference_dequantize(scheme: Scheme, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The format's own reading of one layer's tensors: W [N, K] float32."""
    b = scheme.bits
    if scheme.method == "awq":
        q = unpack_along(t["qweight"], 4, 1, AWQ_ORDER)  # [K, N]
        z = unpack_along(t["qzeros"], 4, 1, AWQ_ORDER)
        g = torch.arange(q.shape[0]) // scheme.group_size
        return ((q - z[g]).float() * t["scales"].float()[g]).t()
    if scheme.method == "gptq":
        q = unpack_along(t["qweight"], b, 0)  # [K, N]
        z = unpack_along(t["qzeros"], b, 1) + (1 if scheme.version == "gptq" else 0)
        g = t["g_idx"].long()
        return ((q - z[g]).float() * t["scales"].float()[g]).t()
    q = unpack_along(t["weight_packed"], b, 1) - (1 << (b - 1))  # [N, K] signed
    k = q.shape[1]
    if "weight_g_idx" in t:
        g = t["weight_g_idx"].long()
    else:
        size = k if scheme.group_size == -1 else scheme.group_size
        g = torch.arange(k) // size
    return q.float() * t["weight_scale"].float()[:, g]


def quantization_config(scheme: Scheme) -> dict:
    if scheme.method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": scheme.group_size,
                "zero_point": True, "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    if scheme.method == "gptq":
        return {"quant_method": "gptq", "bits": scheme.bits, "group_size": scheme.group_size,
                "sym": scheme.sym, "desc_act": scheme.desc_act, "damp_percent": 0.01,
                "checkpoint_format": scheme.version}  # fmt: skip
    weights = {"type": "int", "num_bits": scheme.bits, "symmetric": True, "dynamic": False,
               "strategy": "channel" if scheme.group_size == -1 else "group",
               "group_size": None if scheme.group_size == -1 else scheme.group_size,
               "actorder": "group" if scheme.desc_act else None}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
        },
        "ignore": ["lm_head"],
    }


def quantize_layer(scheme: Scheme, w: torch.Tensor, seed: int) -> Quantized:
    g_idx = None
    if scheme.desc_act:  # act-order: groups over a permutation of the input columns
        k = w.shape[1]
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        size = k if scheme.group_size == -1 else scheme.group_size
        g_idx[perm] = torch.arange(k, dtype=torch.int32) // size
    sym = scheme.method == "compressed-tensors" or (scheme.method == "gptq" and scheme.sym)
    return rtn(w, scheme.bits, scheme.group_size, sym, g_idx)


def quantize_tensors(
    tensors: dict[str, torch.Tensor], scheme: Scheme
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the checkpoint's tensors in `scheme`'s format, float32 tensors of the weights they
    decode to): every attention and MLP projection quantized, the rest as it is."""
    q_tensors, float_tensors = {}, {}
    for tname, w in sorted(tensors.items()):
        is_proj = tname.endswith(".weight") and tname.rsplit(".", 2)[-2] in PROJECTIONS
        if not is_proj:
            q_tensors[tname] = float_tensors[tname] = w
            continue
        # Act-order follows the input's statistics: q/k/v (and gate/up) share one order.
        layer_input = tname.split(".")[2] + tname.rsplit(".", 2)[-2].replace("k_", "q_")
        seed = sum(map(ord, layer_input.replace("v_", "q_").replace("up_", "gate_")))
        qz = quantize_layer(scheme, w, seed=seed)
        prefix = tname.removesuffix(".weight")
        packed = pack(scheme, qz)
        q_tensors |= {f"{prefix}.{k}": v.contiguous() for k, v in packed.items()}
        float_tensors[tname] = reference_dequantize(scheme, packed).contiguous()
        torch.testing.assert_close(float_tensors[tname], qz.dequantize(), rtol=0, atol=0)
    return q_tensors, float_tensors


def write_quantized(
    tensors: dict[str, torch.Tensor], config: dict, out: Path, scheme: Scheme
) -> Path:
    """A checkpoint folder `out` (config.json and model.safetensors) holding `tensors`
    quantized in `scheme`; tokenizer files are the caller's."""
    out.mkdir(parents=True, exist_ok=True)
    q_tensors, _ = quantize_tensors(tensors, scheme)
    save_file(q_tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = dict(config, quantization_config=quantization_config(scheme))
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_int_pair(src: Path, out: Path, scheme: Scheme, name: str) -> tuple[Path, Path]:
    """(quantized checkpoint, float32 checkpoint of its dequantized weights) made from `src`."""
    q_dir, float_dir = out / f"{name}-q", out / f"{name}-float"
    for folder in (q_dir, float_dir):
        shutil.copytree(src, folder)
    q_tensors, float_tensors = quantize_tensors(load_file(src / "model.safetensors"), scheme)
    save_file(q_tensors, q_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(float_tensors, float_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    (q_dir / "config.json").write_text(json.dumps(config))
    return q_dir, float_dir
