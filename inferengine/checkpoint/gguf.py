"""Converts a Llama or Gemma 2/3 GGUF file into a Hugging Face-style float32 model folder.

The folder keeps the GGUF itself and an index of its tensors (`gguf_source.py`): on the CPU the
loader takes the quantized weights from it as they are (`model/loader/gguf_quantized.py`). A
lean conversion (the model cache's) writes float copies only of what that path reads as floats;
the rest is written when a load reads it (`model/loader/gguf_floats.py`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from inferengine.checkpoint.gguf_gemma import (
    GEMMA_ARCHITECTURES,
    GEMMA_CHAT_TEMPLATE,
    attention_shape,
    end_of_turn_id,
    gemma_config,
    gemma_layer_tensors,
)
from inferengine.checkpoint.gguf_source import FLOATS_FILE, block_only, keep_source
from inferengine.errors import ModelLoadError
from inferengine.logger import init_logger

logger = init_logger(__name__)

SUPPORTED_ARCHITECTURES = ("llama", *GEMMA_ARCHITECTURES)
# Dequantized by `gguf.quants`; the K-quants are checked against Transformers' own dequantizer.
SUPPORTED_TYPES = (
    *("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
)
MARKER = ".inferengine-gguf.json"  # written into a finished folder; names the converter version
CONVERTER_VERSION = 2  # 2: the folder keeps the GGUF and its tensor index

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Pre-tokenizers llama.cpp runs with single digits split off before the GPT-2 regex.
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}
_REDOWNLOAD = "re-download it (compare its size or sha256 with the source)"


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, lean: bool = False) -> Path:
    """Write `out_dir` with config.json, model.safetensors (float32) and tokenizer files; with
    `lean`, model-floats.safetensors instead, without the weights our CPU kernels read from the
    kept GGUF (`gguf_source.block_only`), written later if a load reads them as floats.

    The folder is built beside `out_dir` and renamed into place, so it is either complete or
    absent. An earlier conversion in `out_dir` is replaced (moved aside, then deleted); any other
    non-empty `out_dir` is an error.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = _open(gguf_path)
    meta = _Metadata(reader, gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    config = _hf_config(meta, tensors)
    layout = _layout(meta.arch)
    _check_tensors(gguf_path, tensors, config["num_hidden_layers"], layout)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", _generation_config(meta))
        floats, floats_file = tensors, "model.safetensors"
        if lean:
            types = {name: t.tensor_type.name for name, t in tensors.items()}
            skip = block_only(types)
            floats = {name: t for name, t in tensors.items() if name not in skip}
            floats_file = FLOATS_FILE
        _write_weights(tmp / floats_file, floats, config, gguf_path, layout)
        _write_tokenizer(gguf_path, meta, config, tmp)
        keep_source(gguf_path, reader.tensors, meta.arch, tmp)
        _write_json(tmp / MARKER, {"version": CONVERTER_VERSION, "source": str(gguf_path)})
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s to %s", gguf_path, out_dir)
    return out_dir


def _open(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise ModelLoadError(
            f"{path} does not exist or is not a file; pass the path of a .gguf file."
        )
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(
            f"{path} is not a GGUF file (it does not start with 'GGUF'); it may be corrupt or an "
            f"error page saved under that name: {_REDOWNLOAD}."
        )
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader fails with ValueError/IndexError/... deep in numpy
        raise ModelLoadError(
            f"{path} is truncated or corrupt ({type(e).__name__}: {e}); {_REDOWNLOAD}."
        ) from e


class _Metadata:
    """A GGUF's key/value metadata; `arch_key("block_count")` reads `llama.block_count`."""

    def __init__(self, reader: Any, path: Path):
        self.fields, self.path = reader.fields, path
        self.arch = str(self.get("general.architecture", "?"))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def arch_key(self, suffix: str, default: Any = None) -> Any:
        """The value, or `default`; with no default the key must be there."""
        value = self.get(f"{self.arch}.{suffix}", default)
        if value is None:
            raise ModelLoadError(
                f"{self.path} lacks the metadata key {self.arch}.{suffix} that every {self.arch} "
                f"GGUF has; {_REDOWNLOAD}, or load the original Hugging Face safetensors folder."
            )
        return value


class _Layout:
    """How one architecture's GGUF tensors map to Transformers': per-block roles, whether q/k
    rows are in llama.cpp's interleaved rotary order, and what its norm weights carry (Gemma's
    hold 1 + w)."""

    def __init__(self, layer_tensors: dict[str, str], permuted_qk: bool, norm_offset: float):
        self.layer_tensors = layer_tensors
        self.permuted_qk = permuted_qk
        self.norm_offset = norm_offset


def _layout(arch: str) -> _Layout:
    if arch in GEMMA_ARCHITECTURES:
        return _Layout(gemma_layer_tensors(arch), permuted_qk=False, norm_offset=1.0)
    return _Layout(_LAYER_TENSORS, permuted_qk=True, norm_offset=0.0)


def _hf_config(meta: _Metadata, tensors: dict[str, Any]) -> dict[str, Any]:
    """The Transformers `config.json` a GGUF's metadata describes."""
    if meta.arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{meta.path} holds a {meta.arch!r} model; GGUF conversion supports only "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (Llama, SmolLM, Mistral-like; Gemma 2 and 3 "
            "text). Pass the model's Hugging Face folder (config.json + *.safetensors) instead."
        )
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{meta.path} has no token_embd.weight; {_REDOWNLOAD}.")
    vocab_size = int(tensors["token_embd.weight"].shape[1])
    if meta.arch in GEMMA_ARCHITECTURES:
        config = gemma_config(meta, vocab_size, tied="output.weight" not in tensors)
    else:
        config = _llama_config(meta, tensors, vocab_size)
    for name in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            config[f"{name.replace('padding', 'pad')}_token_id"] = int(token_id)
    return config


def _llama_config(meta: _Metadata, tensors: dict[str, Any], vocab_size: int) -> dict[str, Any]:
    hidden, heads, kv_heads, head_dim = attention_shape(meta)
    rope_dim = int(meta.arch_key("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ModelLoadError(
            f"{meta.path} rotates {rope_dim} of {head_dim} head dims (partial rotary), which the "
            "llama architecture does not do; load the original safetensors folder instead."
        )
    theta = _f32(meta.arch_key("rope.freq_base", 10000.0))
    context = int(meta.arch_key("context_length"))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_key("feed_forward_length")),
        "num_hidden_layers": int(meta.arch_key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta.arch_key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": theta,
        "max_position_embeddings": context,
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "torch_dtype": "float32",
    }
    freqs = tensors.get("rope_freqs.weight")
    scaling = _rope_scaling(meta, freqs, theta, head_dim, context)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _f32(value: Any) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(
    meta: _Metadata, freqs: Any, theta: float, head_dim: int, context: int
) -> dict[str, Any] | None:
    if freqs is not None:  # llama.cpp stores Llama 3.1's scaling as per-frequency divisors
        divisors = np.asarray(freqs.data, dtype=np.float64).reshape(-1)
        return _llama3_scaling(meta.path, divisors, theta, head_dim)
    kind = meta.arch_key("rope.scaling.type", "none")
    factor = _f32(meta.arch_key("rope.scaling.factor", 0) or meta.arch_key("rope.scale_linear", 0))
    if kind == "yarn" and factor > 0:
        original = int(meta.arch_key("rope.scaling.original_context_length", context))
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    if kind not in ("linear", "none"):
        raise ModelLoadError(
            f"{meta.path}: rope scaling type {kind!r} is not supported (linear, yarn and Llama 3 "
            "are); load the original Hugging Face safetensors folder instead."
        )
    return {"rope_type": "linear", "factor": factor} if factor not in (0.0, 1.0) else None


def _llama3_divisors(wavelen: np.ndarray, factor: float, low: float, high: float, orig: float):
    smooth = (orig / wavelen - low) / (high - low)
    medium = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, medium))


def _llama3_scaling(path: Path, divisors: np.ndarray, theta: float, head_dim: int) -> dict | None:
    """Recover Llama 3.1 `rope_scaling` from llama.cpp's `rope_freqs` divisors: Meta's standard
    values, or a fit of the ramp between the bands (only orig/low and orig/high matter there, so
    low_freq_factor stays 1)."""
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    factor = round(float(divisors.max()), 6)
    if factor <= 1.0001:
        return None
    candidates = [(1.0, 4.0, 8192)]
    ramp = (divisors > 1 + 1e-4) & (divisors < factor - 1e-4)
    if ramp.sum() >= 2:  # smooth = orig/(high-1) / wavelen - 1/(high-1): a line in 1/wavelen
        smooth = (1 / divisors[ramp] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(1 / wavelen[ramp], smooth, 1)
        if b < 0:
            candidates.append((1.0, round(1.0 - 1.0 / b, 4), round(-a / b)))
    for low, high, orig in candidates:
        if np.allclose(_llama3_divisors(wavelen, factor, low, high, orig), divisors, rtol=1e-3):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": orig,
            }
    raise ModelLoadError(
        f"{path}: rope_freqs.weight does not follow Llama 3 rope scaling, so it cannot be written "
        "to config.json; load the original Hugging Face safetensors folder instead."
    )


def _generation_config(meta: _Metadata) -> dict[str, Any]:
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "eot", "eom")}
    config = {"bos_token_id": ids["bos"]}
    # Chat models end turns with an end-of-turn token that llama.cpp keeps apart from eos.
    if meta.arch in GEMMA_ARCHITECTURES and ids["eot"] is None:
        ids["eot"] = end_of_turn_id(meta)
    eos = list(dict.fromkeys(int(ids[k]) for k in ("eos", "eot", "eom") if ids[k] is not None))
    config["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    config["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    return {k: v if isinstance(v, list) else int(v) for k, v in config.items() if v is not None}


def _hf_name(gguf_name: str, layer_tensors: dict[str, str] = _LAYER_TENSORS) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    stem, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{kind}"
    return None


def _check_tensors(
    path: Path, tensors: dict[str, Any], num_layers: int, layout: _Layout | None = None
) -> None:
    """Fail before any work on a tensor we cannot name or dequantize, or one that is missing."""
    roles = (layout or _layout("llama")).layer_tensors
    expected = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{role}.weight" for i in range(num_layers) for role in roles
    ]
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ModelLoadError(
            f"{path} lacks {len(missing)} tensor(s) the model needs ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); {_REDOWNLOAD}."
        )
    for name, t in tensors.items():
        if name == "rope_freqs.weight":
            continue
        if _hf_name(name, roles) is None:
            raise ModelLoadError(
                f"{path} has a tensor {name!r} that this architecture's models do not have (a "
                "mixture-of-experts or other variant?); load the original Hugging Face "
                "safetensors folder."
            )
        if t.tensor_type.name not in SUPPORTED_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {name} is stored as {t.tensor_type.name}, which InferEngine cannot "
                f"dequantize (supported: {', '.join(SUPPORTED_TYPES)}). Re-quantize the model to "
                "Q8_0 or Q4_K_M with llama.cpp's llama-quantize, or load the original safetensors."
            )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: it stores each head's rotary halves interleaved
    (rows 0, d/2, 1, d/2+1, ...); Transformers keeps the halves apart (rows 0..d/2-1, d/2..d-1)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantized(
    t: Any, shape: tuple[int, ...], heads: dict[str, int], path: Path, norm_offset: float = 0.0
) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    except (ValueError, IndexError) as e:
        raise ModelLoadError(f"{path}: tensor {t.name} is corrupt ({e}); {_REDOWNLOAD}.") from e
    if not np.isfinite(w).all():
        raise ModelLoadError(f"{path}: tensor {t.name} holds NaN or inf; {_REDOWNLOAD}.")
    role = t.name.split(".")[-2]
    if norm_offset and role.endswith("norm"):
        w = w - np.float32(norm_offset)
    return _unpermute(w, heads[role]) if role in heads else w


def _write_weights(
    path: Path,
    tensors: dict[str, Any],
    config: dict[str, Any],
    source: Path,
    layout: _Layout | None = None,
) -> None:
    """model.safetensors in float32, written one tensor at a time so memory holds one tensor."""
    layout = layout or _layout("llama")
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    heads = heads if layout.permuted_qk else {}
    entries = [  # GGUF lists dims innermost first
        (_hf_name(name, layout.layer_tensors), tuple(int(n) for n in reversed(t.shape.tolist())), t)
        for name, t in tensors.items()
        if _hf_name(name, layout.layer_tensors) is not None
    ]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in entries:
        size = 4 * math.prod(shape)
        header[name] = dict(dtype="F32", shape=list(shape), data_offsets=[offset, offset + size])
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for _, shape, t in entries:
            w = _dequantized(t, shape, heads, source, layout.norm_offset)
            f.write(w.astype("<f4").tobytes())


def _write_tokenizer(
    gguf_path: Path, meta: _Metadata, config: dict[str, Any], folder: Path
) -> None:
    """tokenizer.json via Transformers' GGUF tokenizer builder, then a portable tokenizer_config."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    # Read from a private folder, so stray tokenizer files beside the .gguf cannot mix in.
    source = folder / ".source"
    source.mkdir()
    (source / "model.gguf").symlink_to(gguf_path.resolve())
    try:
        tok = AutoTokenizer.from_pretrained(str(source), gguf_file="model.gguf")
    except Exception as e:
        raise ModelLoadError(
            f"cannot build a tokenizer from {gguf_path}'s metadata ({type(e).__name__}: {e}); "
            f"{_REDOWNLOAD}, or load the original Hugging Face folder."
        ) from e
    finally:
        shutil.rmtree(source)
    backend = tok.backend_tokenizer
    if meta.get("tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
        )
    backend.save(str(folder / "tokenizer.json"))
    tokens_field = meta.fields["tokenizer.ggml.tokens"]

    def token(kind: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{kind}_token_id")
        return None if token_id is None else str(tokens_field.contents(int(token_id)))

    spm = meta.get("tokenizer.ggml.model") == "llama"
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding"),
        # Sentencepiece files that predate the flag get a BOS from llama.cpp.
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = meta.get("tokenizer.chat_template")
    if template is None and meta.arch in GEMMA_ARCHITECTURES:
        template = GEMMA_CHAT_TEMPLATE
    if template is not None:
        tokenizer_config["chat_template"] = str(template)
    _write_json(folder / "tokenizer_config.json", tokenizer_config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _publish(tmp: Path, out_dir: Path) -> None:
    """Rename `tmp` to `out_dir`, replacing an earlier conversion but never other files."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ModelLoadError(f"{out_dir} is a file; choose a folder path for the converted model.")
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        raise ModelLoadError(
            f"{out_dir} exists and is not an InferEngine GGUF conversion; choose another output "
            "folder or delete it."
        )
    old = None
    if (out_dir / MARKER).exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        try:
            out_dir.rename(old)
        except FileNotFoundError:  # another process moved it first
            old = None
    try:
        os.rename(tmp, out_dir)  # atomic; replaces an empty directory
    except OSError:
        if not (out_dir / MARKER).exists():
            raise
        logger.info("%s was converted by another process; keeping its copy", out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
