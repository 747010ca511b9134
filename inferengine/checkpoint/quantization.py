"""What a checkpoint's `quantization_config` says, and which quantization a run uses.

Pure Python (no torch): `EngineArgs` checks the flag and the checkpoint before anything loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from inferengine.checkpoint.int_quant import SUPPORTED_INT, IntCheckpoint, int_checkpoint
from inferengine.config import QUANTIZATIONS
from inferengine.errors import ConfigError

_SUPPORTED = (
    "FP8 checkpoints: Hugging Face's 'fp8' quant_method (per-tensor scales, or block scales "
    "with weight_block_size) and 'compressed-tensors' with 8-bit float weights"
)


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a pre-quantized FP8 checkpoint stores its linear layers: `weight` float8_e4m3fn
    [out, in] and `weight_scale` (`weight_scale_inv` for block scales), the multiplier that
    turns the stored values back into weights."""

    method: str  # "fp8" (Hugging Face / vLLM) or "compressed-tensors"
    weight_scales: str  # "tensor", "channel" or "block"
    block_size: tuple[int, int] | None = None  # (rows, columns) one block scale covers
    static_input_scales: bool = False  # `input_scale` tensors present (read and not used)
    ignore: tuple[str, ...] = ()  # modules kept unquantized: names, or "re:<regex>"

    def ignores(self, module_names: list[str]) -> bool:
        """Whether any of a layer's checkpoint module names (e.g. q_proj, k_proj and v_proj
        of one fused qkv_proj) is in the ignore list."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                pattern = re.compile(entry[3:])
                if any(pattern.fullmatch(name) for name in module_names):
                    return True
            elif any(name == entry or name.endswith("." + entry) for name in module_names):
                return True
        return False


def fp8_checkpoint(hf_config: dict[str, Any]) -> Fp8Checkpoint | None:
    """The checkpoint's FP8 format; None when it is not quantized or is an integer format we
    load (`int_quant_checkpoint`). Any other quantization is a ConfigError naming what is
    supported."""
    qc = hf_config.get("quantization_config")
    if not qc or int_quant_checkpoint(hf_config) is not None:
        return None
    method = str(qc.get("quant_method", "?")).lower()
    if method == "fp8":
        return _hf_fp8(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise ConfigError(
        f"this checkpoint is quantized with {method!r}, which we cannot load; supported: "
        f"{_SUPPORTED}; {SUPPORTED_INT}. Use the model's unquantized (bf16/fp16) checkpoint, optionally with "
        "--quantization fp8."
    )


def int_quant_checkpoint(hf_config: dict[str, Any]) -> IntCheckpoint | None:
    """The checkpoint's int4/int8 weight-only format (AWQ, GPTQ, compressed-tensors
    pack-quantized); None for any other (an option of those we cannot serve: ConfigError)."""
    qc = hf_config.get("quantization_config")
    return int_checkpoint(qc) if qc else None


def _hf_fp8(qc: dict[str, Any]) -> Fp8Checkpoint:
    if str(qc.get("fmt", "e4m3")).lower() != "e4m3":
        raise ConfigError(f"FP8 format {qc.get('fmt')!r} is not supported; only e4m3 is.")
    block = qc.get("weight_block_size")
    ignore = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or []
    return Fp8Checkpoint(
        method="fp8",
        weight_scales="block" if block else "tensor",
        block_size=_block(block) if block else None,
        static_input_scales=qc.get("activation_scheme", "dynamic") == "static",
        ignore=tuple(ignore),
    )


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Checkpoint:
    fmt = qc.get("format", "float-quantized")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt != "float-quantized" or not groups:
        raise ConfigError(
            f"compressed-tensors format {fmt!r} is not supported; supported: {_SUPPORTED}; "
            f"{SUPPORTED_INT}."
        )
    schemes = set()
    for group in groups:
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise ConfigError(
                f"compressed-tensors weights {weights.get('type')}/{weights.get('num_bits')} "
                f"bits are not supported; supported: {_SUPPORTED}."
            )
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise ConfigError(
                f"compressed-tensors weight strategy {strategy!r} is not supported (tensor, "
                "channel and block are)."
            )
        block = weights.get("block_structure") if strategy == "block" else None
        inputs = group.get("input_activations") or {}
        static = bool(inputs) and not inputs.get("dynamic", True)
        schemes.add((strategy, _block(block) if block else None, static))
    if len(schemes) > 1:
        raise ConfigError(
            "this compressed-tensors checkpoint mixes weight schemes across layers "
            f"({sorted(map(str, schemes))}); only one FP8 scheme per checkpoint is supported."
        )
    strategy, block, static = schemes.pop()
    if strategy == "block" and block is None:
        raise ConfigError("a compressed-tensors block strategy needs its block_structure.")
    return Fp8Checkpoint(
        method="compressed-tensors",
        weight_scales=strategy,
        block_size=block,
        static_input_scales=static,
        ignore=tuple(qc.get("ignore") or ()),
    )


def _block(value: Any) -> tuple[int, int]:
    if not (isinstance(value, list | tuple) and len(value) == 2):
        raise ConfigError(f"an FP8 block size must be [rows, columns]; got {value!r}.")
    return int(value[0]), int(value[1])


# Architectures whose checkpoints hold fused projections our loader splits row-wise
FUSED_IN_CHECKPOINT = {"Phi3ForCausalLM"}


def resolve_quantization(
    flag: str | None, hf_config: dict[str, Any], native: bool = True
) -> str | None:
    """The run's quantization ("fp8", an integer checkpoint's method: "awq", "gptq",
    "compressed-tensors", or None) from `--quantization` and the checkpoint: a pre-quantized
    checkpoint is quantized without the flag (as in vLLM)."""
    name = "none" if flag is None else str(flag).lower()
    if name not in QUANTIZATIONS:
        raise ConfigError(
            f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got {flag!r}. "
            f"Pre-quantized {_SUPPORTED} load without the flag."
        )
    integer = int_quant_checkpoint(hf_config)
    if integer is not None:
        if flag is not None:
            raise ConfigError(
                f"this checkpoint is {integer.method} int{integer.bits} and loads only as it is: "
                f"drop --quantization {flag}."
            )
        if not native:
            raise ConfigError(
                f"{integer.method} checkpoints need one of our own model implementations; this "
                "architecture runs on the Transformers fallback (or --model-impl transformers "
                "was given)."
            )
        if FUSED_IN_CHECKPOINT & set(hf_config.get("architectures") or ()):
            raise ConfigError(
                f"{integer.method} checkpoints of {', '.join(hf_config['architectures'])} are "
                "not supported yet: its checkpoint stores qkv_proj and gate_up_proj fused, and "
                "packed integer weights cannot be split as the float ones are. Use the float "
                "checkpoint (optionally with --quantization fp8)."
            )
        return integer.method
    checkpoint = fp8_checkpoint(hf_config)
    if checkpoint is not None and flag is not None and name == "none":
        raise ConfigError(
            f"this checkpoint is FP8 ({checkpoint.method}) and loads only as FP8: drop "
            "--quantization none (or pass fp8)."
        )
    quantization = "fp8" if name == "fp8" or checkpoint is not None else None
    if quantization is not None and not native:
        raise ConfigError(
            "--quantization fp8 needs one of our own model implementations; this architecture "
            "runs on the Transformers fallback (or --model-impl transformers was given), which "
            "runs unquantized. Use the unquantized checkpoint without --quantization."
        )
    return quantization
