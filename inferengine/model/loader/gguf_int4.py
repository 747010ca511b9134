"""GGUF weights kept 4-bit on the CPU: Q4_0, Q4_1 and Q4_K linear weights go from the GGUF
beside a converted folder straight into int4 layers (`layers/quantized_cpu.py`), never to float.

Each of those types is, exactly, int4 values in groups of 32 with one scale and one offset per
group, which is the packed kernel's form `w = (q - 8) * scale + zero`:
- Q4_0 (fp16 d, 32 x 4 bits): w = d (q - 8): scale d, zero 0;
- Q4_1 (fp16 d, m): w = d q + m: scale d, zero m + 8 d;
- Q4_K (256 weights: fp16 d, dmin, eight 6-bit (sc, m) pairs): w = d sc q - dmin m per 32:
  scale d sc, zero 8 d sc - dmin m.
Other types (Q5_*, Q6_K, Q8_0, floats) have no exact int4 form; their layers load the converted
folder's dequantized weights as before. A fused layer (qkv, gate_up) is int4 only when every
shard is: the shards share the input features, so their rows stack into one packed weight.

The LM head is int4 like the rest; one tied to a Q8_0 embedding (SmolLM2's, a fifth of the
model) becomes two int4 halves (`int8_as_int4_pair`) beside the dense embedding it shares,
which takes over for batches of more than a few rows (`Int4LMHead`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from inferengine.config import ModelConfig
from inferengine.logger import init_logger
from inferengine.model.layers.fp16_cpu import fp16_gemm_available
from inferengine.model.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from inferengine.model.layers.quantized_cpu import (
    INT4_GROUP,
    Int4CpuLinearMethod,
    Int4LMHead,
    Int4Weight,
    can_pack,
    compute_dtype_for,
    int4_kernel_is_fast,
    int8_as_int4_pair,
)
from inferengine.model.layers.vocab import ParallelLMHead
from inferengine.model.loader.gguf import _hf_name, _layout, _unpermute
from inferengine.model.loader.gguf_source import GGUFSource, SourceTensor, has_source

logger = init_logger(__name__)

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}


def int4_weight(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> Int4Weight:
    """The int4 form of one GGUF tensor's blocks (`data`: uint8 [rows, row bytes]) of weight
    `shape` (rows, columns)."""
    rows, cols = shape
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[qtype])
    q, scale, zero = _DECODERS[qtype](blocks)
    return Int4Weight(
        torch.from_numpy(np.ascontiguousarray(q.reshape(rows, cols))),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, cols // INT4_GROUP))),
        torch.from_numpy(np.ascontiguousarray(zero.reshape(rows, cols // INT4_GROUP))),
    )


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per value (last axis) as float16, widened to float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles first, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[..., 0:2])
    return _nibbles(blocks[..., 2:18]), d, np.zeros_like(d)


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    return _nibbles(blocks[..., 4:20]), d, m + 8 * d


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K

    rows, n = blocks.shape[:2]
    d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(rows * n, 12))
    scale = d * sc.reshape(rows, n, 8).astype(np.float32)
    offset = dmin * m.reshape(rows, n, 8).astype(np.float32)
    # Four chunks of 32 bytes: sub-block 2i in the low nibbles, 2i + 1 in the high ones.
    qs = blocks[..., 16:144].reshape(rows, n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(rows, n, 8, 32)
    return q, scale, 8 * scale - offset


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k}


def install_int4_linears(
    model: nn.Module, model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> frozenset[str]:
    """Give each linear layer whose GGUF weights are int4 an int4 `quant_method`, filled from
    the GGUF; return the checkpoint names of the weights it took (not to be read again). Does
    nothing off the CPU, for folders not converted from a GGUF, or when the dense path is
    asked for or faster (logged)."""
    folder = Path(model_config.model_path)
    if device.type != "cpu" or model_config.load_format == "dummy" or not has_source(folder):
        return frozenset()
    reason = _why_dense(model_config)
    if reason is not None:
        logger.info(
            "GGUF weights not int4 (dense, %s): %s", str(dtype).removeprefix("torch."), reason
        )
        return frozenset()
    source = GGUFSource(folder)
    layout = _layout(source.architecture)
    by_name = {_hf_name(n, layout.layer_tensors): t for n, t in source.tensors.items()}
    heads = _permuted_heads(model_config.hf_config) if layout.permuted_qk else {}
    stacked = getattr(model, "stacked_params", ())
    taken: set[str] = set()
    int4_types: Counter[str] = Counter()
    dense_types: Counter[str] = Counter()
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        names = _checkpoint_weights(name, module, stacked)
        if not names:
            continue
        tensors = [by_name.get(n) for n in names]
        types = [t.type if t is not None else "missing" for t in tensors]
        if not all(t in INT4_TYPES for t in types):
            dense_types.update(t for t in types if t not in INT4_TYPES)
            continue
        parts = [_weight(source, t, heads) for t in tensors]
        weight = Int4Weight.stack_rows(parts)
        if not can_pack(weight.shape):
            dense_types.update(f"{t} (shape {weight.shape})" for t in types)
            continue
        module.quant_method = Int4CpuLinearMethod(module, weight, compute_dtype_for(dtype))
        taken.update(names)
        int4_types.update(types)
    head = _install_lm_head(model, source, by_name, dtype)
    if head is not None:
        int4_types[f"LM head {head}" + (" as two int4 halves" if head == "Q8_0" else "")] += 1
        taken.add("lm_head.weight")  # untied: not read; tied: the checkpoint has none
    _log_summary(source.path, int4_types, dense_types, dtype)
    return frozenset(taken)


def _install_lm_head(
    model: nn.Module, source: GGUFSource, by_name: dict[Any, SourceTensor], dtype: torch.dtype
) -> str | None:
    """Replace the model's LM head by an int4 one where its GGUF weight allows; its type."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, ParallelLMHead):
        return None
    tied = "lm_head.weight" not in by_name
    tensor = by_name.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    qtype = tensor.type if tensor is not None else None
    shape = (int(head.weight.shape[0]), int(head.weight.shape[1]))
    if qtype in INT4_TYPES:
        weight, repeats = _weight(source, tensor, {}), 1
    elif qtype == "Q8_0" and tied:  # two halves: worth it only beside the dense embedding
        weight, repeats = _q8_0_pair(source.data(tensor), shape), 2
    else:
        return None
    if weight.shape != (shape[0], shape[1] * repeats):
        return None
    model.lm_head = Int4LMHead(
        head.vocab_size,
        weight.pad_rows(),
        compute_dtype_for(dtype),
        repeats,
        head.weight if tied else None,
    )
    return qtype


def _q8_0_pair(data: np.ndarray, shape: tuple[int, int]) -> Int4Weight:
    """GGUF Q8_0 (fp16 d, 32 int8 q: w = d q) as two int4 halves [rows, 2 cols]."""
    rows, cols = shape
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
    return int8_as_int4_pair(torch.from_numpy(q), torch.from_numpy(_f16(blocks[..., 0:2])))


def skip_names(
    wanted: Callable[[str], bool] | None, names: frozenset[str]
) -> Callable[[str], bool] | None:
    """`wanted` (a model's checkpoint filter, or None) refusing `names` as well."""
    if not names:
        return wanted
    return lambda name: name not in names and (wanted is None or wanted(name))


def _why_dense(model_config: ModelConfig) -> str | None:
    from inferengine.distributed.parallel_state import get_tp_size

    if model_config.gguf_dequantize:
        return "--gguf-dequantize"
    if model_config.quantization is not None:
        return f"--quantization {model_config.quantization} quantizes the float weights instead"
    if get_tp_size() > 1:
        return "int4 layers are not split across tensor-parallel ranks yet"
    if not int4_kernel_is_fast():
        capability = torch.backends.cpu.get_cpu_capability()
        return (
            f"torch's int4 CPU kernel is fast only with AVX-512 (torch uses {capability} here), "
            "so dense weights are faster"
        )
    return None


def wants_fp16_weights(model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """A GGUF's weights load dense but then run through fbgemm's float16 GEMM
    (`layers/fp16_cpu.py`): a converted GGUF on a CPU whose int4 kernel is slow, a float32
    model on one rank, and neither --gguf-dequantize nor --quantization asked for."""
    from inferengine.distributed.parallel_state import get_tp_size

    folder = Path(model_config.model_path)
    if device.type != "cpu" or model_config.load_format == "dummy" or not has_source(folder):
        return False
    if dtype != torch.float32 or get_tp_size() > 1:
        return False
    if model_config.gguf_dequantize or model_config.quantization is not None:
        return False
    return not int4_kernel_is_fast() and fp16_gemm_available()


def _permuted_heads(hf_config: dict[str, Any]) -> dict[str, int]:
    """llama.cpp interleaves each head's rotary halves in q/k rows; the head count undoes it."""
    heads = int(hf_config["num_attention_heads"])
    return {"attn_q": heads, "attn_k": int(hf_config.get("num_key_value_heads") or heads)}


def _weight(source: GGUFSource, tensor: SourceTensor, heads: dict[str, int]) -> Int4Weight:
    data = source.data(tensor)
    role = tensor.name.split(".")[-2]
    if role in heads:
        data = _unpermute(data, heads[role])
    rows, cols = tensor.shape
    return int4_weight(data, tensor.type, (rows, cols))


def _checkpoint_weights(name: str, module: nn.Module, stacked: Any) -> list[str]:
    """The checkpoint weights of our layer `name` in row order: one, or each shard of a fused
    layer (qkv_proj <- q_proj, k_proj, v_proj via the model's `stacked_params`)."""
    last = name.rsplit(".", 1)[-1]
    shards = []
    for hf_part, our_part, shard_id in stacked:
        if our_part == last:
            index = QKVParallelLinear.SHARD_IDS[shard_id] if isinstance(shard_id, str) else shard_id
            shards.append((index, hf_part))
    if not shards:
        return [f"{name}.weight"]
    prefix = name[: -len(last)]
    sizes = getattr(module, "output_sizes", [])
    if len(shards) != len(sizes):
        return []  # not a layout we know: stays dense (a missing name is never int4)
    return [f"{prefix}{hf_part}.weight" for _, hf_part in sorted(shards)]


def _log_summary(source: Path, int4: Counter[str], dense: Counter[str], dtype: torch.dtype) -> None:
    def listed(types: Counter[str]) -> str:
        return ", ".join(f"{n} {t}" for t, n in sorted(types.items()))

    dtype_name = str(dtype).removeprefix("torch.")
    if not int4:
        logger.info(
            "GGUF weights dequantized to %s: no linear layer is all Q4_0/Q4_1/Q4_K (%s)",
            dtype_name,
            listed(dense) or "none found",
        )
        return
    logger.info(
        "GGUF weights kept 4-bit on the CPU from %s: %s tensor(s)%s",
        source,
        listed(int4),
        f"; dequantized to {dtype_name} (no exact int4 form): {listed(dense)}" if dense else "",
    )
