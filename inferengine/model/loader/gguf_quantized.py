"""GGUF weights kept quantized on the CPU: Q4_0, Q4_1, Q4_K, Q8_0 and Q5_0 linear weights go
from the GGUF beside a converted folder straight into block-quantized layers
(`layers/block_quant_cpu.py`, run by our C++ kernels), never to float: the model is built in
`GGUFBlockConfig`, whose layers are created over the GGUF's blocks.

Each of those types is, exactly, integer values in blocks of 32 with one scale (and, for the
4-bit ones, one offset) per block:
- Q4_0 (fp16 d, 32 x 4 bits): w = d u - 8 d: q4, scale d, offset -8 d;
- Q4_1 (fp16 d, m): w = d u + m: q4, scale d, offset m;
- Q4_K (256 weights: fp16 d, dmin, eight 6-bit (sc, m) pairs): w = d sc u - dmin m per 32:
  q4, scale d sc, offset -dmin m;
- Q8_0 (fp16 d, 32 int8): w = d q: q8;
- Q5_0 (fp16 d, 32 x 5 bits): w = d (u - 16): q8 with values u - 16.
Other types (Q5_1, Q6_K, the other K-quants, floats) load the converted folder's dequantized
weights as before. A fused layer (qkv, gate_up) stays quantized only when its shards are of
one kind (their rows stack into one weight). The LM head is quantized like the rest, and so is
the token embedding, whose lookups dequantize the rows they read: one tied to the head
(SmolLM2's Q8_0, a fifth of the model) is then never held as floats.

Where our kernels cannot be built (no compiler, not x86-64 with AVX2) the weights load dense;
on x86 a float32 model's then run through fbgemm's float16 GEMM (`layers/fp16_cpu.py`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from inferengine.checkpoint.gguf import _hf_name, _layout, _unpermute
from inferengine.checkpoint.gguf_source import (
    BLOCK_TYPES,
    Q4_TYPES,
    GGUFSource,
    SourceTensor,
    has_source,
)
from inferengine.config import ModelConfig
from inferengine.kernels import cpu_native
from inferengine.logger import init_logger
from inferengine.model.layers.block_quant_cpu import (
    BlockQuantEmbedding,
    BlockQuantLinearMethod,
    BlockQuantLMHead,
    BlockQuantWeight,
    fits_kernels,
)
from inferengine.model.layers.fp16_cpu import fp16_gemm_available
from inferengine.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from inferengine.model.quantization.base import QuantizationConfig

logger = init_logger(__name__)

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q8_0": 34, "Q5_0": 22}
_GROUP = cpu_native.BLOCK


def block_weight(data: np.ndarray, qtype: str, shape: tuple[int, int]) -> BlockQuantWeight:
    """One GGUF tensor's blocks (`data`: uint8 [rows, row bytes]) of weight `shape` (rows,
    columns) in block form: q4 for Q4_0, Q4_1 and Q4_K, q8 for Q8_0 and Q5_0, exactly."""
    rows, cols = shape
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[qtype])
    values, scale, offset = _DECODERS[qtype](blocks)

    def tensor(a: np.ndarray, width: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, width)))

    return BlockQuantWeight(
        "q4" if qtype in Q4_TYPES else "q8",
        tensor(values, cols),
        tensor(scale, cols // _GROUP),
        None if offset is None else tensor(offset, cols // _GROUP),
    )


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per value (last axis) as float16, widened to float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: the low nibbles first, then the high ones (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# Each decoder: GGUF blocks [rows, n, bytes] -> (values, scale, offset or None) per block of 32,
# w = scale * values + offset.
def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(blocks[..., 0:2])
    return _nibbles(blocks[..., 2:18]), d, -8 * d


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(blocks[..., 4:20]), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


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
    return q, scale, -offset


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return np.ascontiguousarray(blocks[..., 2:34]).view(np.int8), _f16(blocks[..., 0:2]), None


def _q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """Q5_0 (fp16 d, 32 high bits, 16 bytes of low nibbles): w = d (q - 16), q in 0..31."""
    high = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")  # bit j: value j
    q = _nibbles(blocks[..., 6:22]) | (high << 4)
    return (q.astype(np.int16) - 16).astype(np.int8), _f16(blocks[..., 0:2]), None


_DECODERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q8_0": _q8_0, "Q5_0": _q5_0}


class GGUFBlockConfig(QuantizationConfig):
    """A converted GGUF's weights on the CPU: each linear layer whose GGUF weights are of a
    type our kernels take is built over them (`BlockQuantLinearMethod`, its blocks read from
    the GGUF as the layer is built); the others are built unquantized and load the folder's
    float weights. After construction the token embedding and LM head are swapped for
    block-quantized ones where their GGUF weights allow (they are not built by a quant method
    yet). `blocks` False (our kernels unavailable): every layer loads dense.

    With nothing kept quantized, a float32 model's dense linears and head run through fbgemm's
    float16 GEMM after loading (`fp16`; `layers/fp16_cpu.py`)."""

    name = "gguf"

    def __init__(
        self,
        folder: Path,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        *,
        blocks: bool,
        fp16: bool,
        packed_modules: Any = (),
    ):
        super().__init__(packed_modules)
        self.source = GGUFSource(folder)
        layout = _layout(self.source.architecture)
        self.by_name = {
            _hf_name(n, layout.layer_tensors): t for n, t in self.source.tensors.items()
        }
        self.heads = _permuted_heads(hf_config) if layout.permuted_qk else {}
        self.dtype = dtype
        self.blocks = blocks
        self.fp16 = fp16
        self.taken: set[str] = set()  # checkpoint names read from the GGUF, not as floats
        self.kept: Counter[str] = Counter()
        self.dense_types: Counter[str] = Counter()

    def linear_method(self, layer: nn.Module, prefix: str) -> BlockQuantLinearMethod | None:
        if not self.blocks:
            return None
        modules = self.checkpoint_modules(prefix, len(layer.output_sizes))
        if not modules:
            return None  # not a layout we know: stays dense (a missing name is never quantized)
        names = [f"{m}.weight" for m in modules]
        tensors = [self.by_name.get(n) for n in names]
        types = [t.type if t is not None else "missing" for t in tensors]
        if not all(t in BLOCK_TYPES for t in types):
            self.dense_types.update(t for t in types if t not in BLOCK_TYPES)
            return None
        weight = BlockQuantWeight.stack_rows(
            [_block(self.source, t, self.heads) for t in tensors if t]
        )
        if weight is None or not fits_kernels(weight.shape):
            self.dense_types.update(f"{t} (mixed kinds or shape)" for t in types)
            return None
        self.taken.update(names)
        self.kept.update(types)
        return BlockQuantLinearMethod(weight)

    def finish_construction(self, model: nn.Module) -> None:
        """The embedding and LM head swapped for ones over the GGUF's blocks where those allow
        (not built by a quant method yet); the summary log line."""
        if self.blocks:
            embedding = _install_embedding(model, self.source, self.by_name, self.dtype)
            if embedding is not None:
                self.kept[f"embedding {embedding}"] += 1
                self.taken.add("model.embed_tokens.weight")
            head = _install_lm_head(model, self.source, self.by_name, embedding is None)
            if head is not None:
                self.kept[f"LM head {head}"] += 1
                self.taken.add("lm_head.weight")  # untied: not read; tied: the checkpoint has none
            _log_summary(self.source.path, self.kept, self.dense_types, self.dtype)

    def skipped_checkpoint_names(self) -> frozenset[str]:
        return frozenset(self.taken)

    def process_after_loading(self, model: nn.Module) -> None:
        super().process_after_loading(model)
        if self.fp16 and not self.taken:
            from inferengine.model.layers.fp16_cpu import pack_linears_fp16

            logger.info(
                "GGUF weights: %d linear layers as float16 under fbgemm's GEMM (float32 compute, "
                "half the bytes of float32); --gguf-dequantize keeps them float32",
                pack_linears_fp16(model),
            )

    def describe(self) -> str:
        return " with quantized GGUF weights" if self.taken else ""


def gguf_quant_config(
    model_config: ModelConfig, device: torch.device, dtype: torch.dtype, packed_modules: Any = ()
) -> GGUFBlockConfig | None:
    """The format of a folder converted from a GGUF, loaded on the CPU: its quantized weights
    kept in their blocks (unless the dense path is asked for or our kernels are unavailable,
    logged), or its dense float32 weights under fbgemm's float16 GEMM. None: plain floats (off
    the CPU, dummy weights, a folder not converted from a GGUF, or neither applies)."""
    folder = Path(model_config.model_path)
    if device.type != "cpu" or model_config.load_format == "dummy" or not has_source(folder):
        return None
    reason = _why_dense(model_config)
    if reason is None and cpu_native.native_ops() is None:
        reason = f"our CPU kernels are unavailable ({cpu_native.unavailable_reason()})"
    if reason is not None:
        logger.info("GGUF weights dequantized to %s: %s", str(dtype).removeprefix("torch."), reason)
    fp16 = wants_fp16_weights(model_config, device, dtype)
    if reason is not None and not fp16:
        return None
    return GGUFBlockConfig(
        folder,
        model_config.hf_config,
        dtype,
        blocks=reason is None,
        fp16=fp16,
        packed_modules=packed_modules,
    )


def _install_embedding(
    model: nn.Module, source: GGUFSource, by_name: dict[Any, SourceTensor], dtype: torch.dtype
) -> str | None:
    """Replace the model's token embedding by a block-quantized one where its GGUF weight
    allows; its type."""
    inner = getattr(model, "model", None)
    embedding = getattr(inner, "embed_tokens", None)
    tensor = by_name.get("model.embed_tokens.weight")
    if not isinstance(embedding, VocabParallelEmbedding) or tensor is None:
        return None
    if tensor.type not in BLOCK_TYPES or tensor.shape != tuple(embedding.weight.shape):
        return None
    inner.embed_tokens = BlockQuantEmbedding(_block(source, tensor, {}), dtype)
    return tensor.type


def _install_lm_head(
    model: nn.Module,
    source: GGUFSource,
    by_name: dict[Any, SourceTensor],
    dense_table: bool = True,
) -> str | None:
    """Replace the model's LM head by a block-quantized one where its GGUF weight allows; its
    type. A head tied to a dense embedding (`dense_table`) keeps that table for the lookups."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, ParallelLMHead):
        return None
    tied = "lm_head.weight" not in by_name
    tensor = by_name.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    if tensor is None or tensor.type not in BLOCK_TYPES:
        return None
    weight = _block(source, tensor, {})
    if weight.shape != tuple(head.weight.shape) or not fits_kernels(weight.shape):
        return None
    table = head.weight if tied and dense_table else None
    model.lm_head = BlockQuantLMHead(head.vocab_size, weight, table)
    return tensor.type


def skip_names(
    wanted: Callable[[str], bool] | None, names: frozenset[str]
) -> Callable[[str], bool] | None:
    """`wanted` (a model's checkpoint filter, or None) refusing `names` as well."""
    if not names:
        return wanted
    return lambda name: name not in names and (wanted is None or wanted(name))


def _why_dense(model_config: ModelConfig) -> str | None:
    """Why the GGUF's weights must load dense, or None."""
    from inferengine.distributed.parallel_state import get_tp_size

    if model_config.gguf_dequantize:
        return "--gguf-dequantize"
    if model_config.quantization is not None:
        return f"--quantization {model_config.quantization} quantizes the float weights instead"
    if get_tp_size() > 1:
        return "quantized layers are not split across tensor-parallel ranks yet"
    return None


def wants_fp16_weights(model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """A GGUF's weights that loaded dense then run through fbgemm's float16 GEMM
    (`layers/fp16_cpu.py`): a converted GGUF, a float32 model on one rank, fbgemm present, and
    neither --gguf-dequantize nor --quantization asked for."""
    from inferengine.distributed.parallel_state import get_tp_size

    folder = Path(model_config.model_path)
    if device.type != "cpu" or model_config.load_format == "dummy" or not has_source(folder):
        return False
    if dtype != torch.float32 or get_tp_size() > 1:
        return False
    if model_config.gguf_dequantize or model_config.quantization is not None:
        return False
    return fp16_gemm_available()


def _permuted_heads(hf_config: dict[str, Any]) -> dict[str, int]:
    """llama.cpp interleaves each head's rotary halves in q/k rows; the head count undoes it."""
    heads = int(hf_config["num_attention_heads"])
    return {"attn_q": heads, "attn_k": int(hf_config.get("num_key_value_heads") or heads)}


def _block(source: GGUFSource, tensor: SourceTensor, heads: dict[str, int]) -> BlockQuantWeight:
    data = source.data(tensor)
    role = tensor.name.split(".")[-2]
    if role in heads:
        data = _unpermute(data, heads[role])
    rows, cols = tensor.shape
    return block_weight(data, tensor.type, (rows, cols))


def _log_summary(source: Path, kept: Counter[str], dense: Counter[str], dtype: torch.dtype) -> None:
    def listed(types: Counter[str]) -> str:
        return ", ".join(f"{n} {t}" for t, n in sorted(types.items()))

    dtype_name = str(dtype).removeprefix("torch.")
    if not kept:
        logger.info(
            "GGUF weights dequantized to %s: no linear layer's weights are all of the types our "
            "kernels take (%s)",
            dtype_name,
            listed(dense) or "none found",
        )
        return
    ops = cpu_native.native_ops()
    logger.info(
        "GGUF weights kept quantized on the CPU (our kernels, %s) from %s: %s tensor(s)%s",
        ops.isa() if ops is not None else "?",
        source,
        listed(kept),
        f"; dequantized to {dtype_name}: {listed(dense)}" if dense else "",
    )
