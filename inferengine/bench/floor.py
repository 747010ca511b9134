"""The bandwidth floor of a decode step: the bytes it must read, over the GPU's measured copy rate.

A decode step reads every weight of the layers, the final norm and the LM head once, and the KV
cache of each sequence's context. It does not read the input embedding table (only one row per
token, which is counted), so an untied embedding is left out; a tied one is read as the LM head.
Dense decoder configs (Llama, Mistral, Qwen2, Qwen3) only; others give None with the reason.
Under tensor parallelism the floor is one rank's: its slice of every projection, of the LM head
and of the KV heads (each rank keeps at least one), norms whole, all ranks reading at once.
With FP8 weights (`--quantization fp8`, or an FP8 checkpoint) the attention and MLP
projections count one byte a weight plus a float32 scale per output row (the LM head, norms and
biases stay in the model dtype); with an fp8 KV cache (`--kv-cache-dtype fp8*`) a cached element
counts one byte.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from inferengine.checkpoint.quantization import fp8_checkpoint
from inferengine.checkpoint.text_config import text_only_config
from inferengine.errors import ConfigError

DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class DecodeBytes:
    weights: int  # layers + final norm + LM head
    kv_cache: int  # the contexts' keys and values
    embedding_rows: int  # one input embedding row per sequence

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.embedding_rows


def decode_step_bytes(
    config: dict,
    batch: int,
    context_len: float,
    dtype_bytes: int = 2,
    tp: int = 1,
    fp8_weights: bool = False,
    fp8_kv: bool = False,
) -> DecodeBytes:
    """Bytes one rank of `tp` reads in a decode step of `batch` sequences of `context_len`."""
    model_type = config.get("model_type")
    if model_type not in DENSE_MODEL_TYPES:
        raise ValueError(f"no decode byte count for model_type {model_type!r}")
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or h // heads
    q, kv = heads // tp * head_dim, max(kv_heads // tp, 1) * head_dim
    inter = -(-config["intermediate_size"] // tp)
    projections = h * q + 2 * h * kv + q * h + 3 * h * inter
    output_rows = q + 2 * kv + h + 2 * inter + h  # qkv, o, gate_up, down
    other = 2 * h  # two RMS norms
    if model_type == "qwen2" or config.get("attention_bias"):
        other += q + 2 * kv  # q, k and v biases
    if model_type != "qwen2" and config.get("attention_bias"):
        other += h  # o_proj's bias (Qwen2 has none)
    if config.get("mlp_bias"):
        other += 2 * inter + h
    if model_type == "qwen3":
        other += 2 * head_dim  # q and k norms
    layers = config["num_hidden_layers"]
    if fp8_weights:
        layer_bytes = projections + 4 * output_rows + other * dtype_bytes
    else:
        layer_bytes = (projections + other) * dtype_bytes
    head = (h + -(-config["vocab_size"] // tp) * h) * dtype_bytes  # final norm and LM head
    kv_per_token = layers * 2 * kv
    return DecodeBytes(
        weights=layers * layer_bytes + head,
        kv_cache=round(batch * context_len * kv_per_token * (1 if fp8_kv else dtype_bytes)),
        embedding_rows=batch * h * dtype_bytes,
    )


def batch1_floor(
    model_dir: str | Path | None,
    input_len: float,
    output_len: float,
    copy_gbps: float | None,
    tp: int = 1,
    fp8_weights: bool = False,
    fp8_kv: bool = False,
) -> dict:
    """The floor of a batch-1 decode step at the mean context (prompt + half the output), on
    one rank of `tp` (each rank reading its slice at `copy_gbps`)."""
    if copy_gbps is None:
        return {"floor_ms": None, "reason": "no CUDA device to measure the copy rate on"}
    if model_dir is None:
        return {"floor_ms": None, "reason": "no --model-dir to read the config from"}
    try:
        config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
        config = text_only_config(config)  # a multimodal Gemma 3's text settings
        dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        context = input_len + output_len / 2
        dtype_bytes = DTYPE_BYTES.get(str(dtype), 2)
        counted = decode_step_bytes(config, 1, context, dtype_bytes, tp, fp8_weights, fp8_kv)
    except (OSError, ValueError, KeyError) as e:
        return {"floor_ms": None, "reason": f"{type(e).__name__}: {e}"}
    return {
        "floor_ms": counted.total / (copy_gbps * 1e9) * 1e3,
        "bytes": {**asdict(counted), "total": counted.total},
        "context_len": context,
        "copy_gbps": copy_gbps,
        "tensor_parallel_size": tp,
        "fp8_weights": fp8_weights,
        "fp8_kv_cache": fp8_kv,
        "counts": "a rank's layers, final norm and LM head, KV of the context, an embedding row",
    }


def server_flag(command: str | None, names: tuple[str, ...]) -> str | None:
    """The value a server command line gives a flag (`--x v` or `--x=v`; the last one wins, as
    with argparse), else None."""
    found = None
    words = shlex.split(command or "")
    for i, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in names:
            found = value if eq else (words[i + 1] if i + 1 < len(words) else "")
    return found


def fp8_formats(command: str | None, model_dir: str | Path | None = None) -> tuple[bool, bool]:
    """(FP8 weights, fp8 KV cache) of a server: from its `--quantization` and `--kv-cache-dtype`
    flags, and without the first, from an FP8 checkpoint's `quantization_config` in
    `model_dir`. Defaults set through environment variables are not seen."""
    quantization = (server_flag(command, ("--quantization", "-q")) or "").lower()
    kv_dtype = (server_flag(command, ("--kv-cache-dtype",)) or "").lower()
    weights = quantization == "fp8"
    if not quantization and model_dir is not None:
        try:
            config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
            weights = fp8_checkpoint(config) is not None
        except (OSError, ValueError, ConfigError):
            weights = False
    return weights, kv_dtype.startswith("fp8")
