"""What an AWQ, GPTQ or compressed-tensors pack-quantized checkpoint's `quantization_config` says
(int4/int8 weight-only), torch-free: every option we cannot serve is a ConfigError naming it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from inferengine.errors import ConfigError

INT_METHODS = ("awq", "gptq", "compressed-tensors")

SUPPORTED_INT = (
    "AWQ (bits 4, version gemm, zero_point true, group_size > 0), GPTQ (bits 4 or 8, sym "
    "true/false, desc_act with g_idx, checkpoint_format gptq or gptq_v2) and compressed-tensors "
    "pack-quantized (int 4/8-bit symmetric weights, group or channel strategy, no activation "
    "quantization)"
)


@dataclass(frozen=True)
class IntCheckpoint:
    """How a weight-only integer checkpoint stores its linear layers (the tensors each method
    reads are listed in `model/quantization/{awq,gptq,compressed_tensors}.py`)."""

    method: str  # "awq", "gptq" or "compressed-tensors"
    bits: int  # 4 or 8
    group_size: int  # input features per scale; -1: one group over all inputs (per channel)
    symmetric: bool  # no stored zero points (GPTQ sym stores them anyway; we read them)
    act_order: bool = False  # groups given per input row by a `g_idx` tensor
    zeros_offset: int = 0  # GPTQ v1 stores zero - 1: add this back
    ignore: tuple[str, ...] = ()  # modules kept unquantized: names, or "re:<regex>"
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors: what the scheme applies to

    def quantizes(self, module_names: list[str]) -> bool:
        """Whether a layer (its checkpoint module names, several for a fused layer) is
        quantized: targeted, and none of its names ignored."""
        if _matches(self.ignore, module_names):
            return False
        return "Linear" in self.targets or _matches(self.targets, module_names)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"g{self.group_size}"
        order = ", act-order" if self.act_order else ""
        sym = "sym" if self.symmetric else "asym"
        return f" with {self.method} int{self.bits} weights ({group}, {sym}{order})"


def _matches(entries: tuple[str, ...], module_names: list[str]) -> bool:
    for entry in entries:
        if entry.startswith("re:"):
            pattern = re.compile(entry[3:])
            if any(pattern.fullmatch(name) for name in module_names):
                return True
        elif any(name == entry or name.endswith("." + entry) for name in module_names):
            return True
    return False


def int_checkpoint(qc: dict[str, Any]) -> IntCheckpoint | None:
    """The integer format of a `quantization_config`; None when it is not one (FP8, say)."""
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return _awq(qc)
    if method == "gptq":
        return _gptq(qc)
    if method == "compressed-tensors" and qc.get("format") == "pack-quantized":
        return _pack_quantized(qc)
    return None


def _refuse(what: str) -> ConfigError:
    return ConfigError(f"{what} is not supported; supported: {SUPPORTED_INT}.")


def _group(value: Any, method: str) -> int:
    group = -1 if value is None else int(value)
    if group != -1 and (group <= 0 or group % 8):
        raise _refuse(f"{method} group_size {value!r}")
    return group


def _awq(qc: dict[str, Any]) -> IntCheckpoint:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(f"AWQ version {version!r} (its packing differs from gemm's)")
    if qc.get("bits", qc.get("w_bit", 4)) != 4:
        raise _refuse(f"AWQ bits {qc.get('bits', qc.get('w_bit'))!r}")
    if not qc.get("zero_point", True):
        raise _refuse("AWQ zero_point false")
    group = _group(qc.get("group_size", qc.get("q_group_size", 128)), "AWQ")
    if group == -1:
        raise _refuse("AWQ group_size -1")
    return IntCheckpoint(
        "awq", 4, group, symmetric=False, ignore=tuple(qc.get("modules_to_not_convert") or ())
    )


def _gptq(qc: dict[str, Any]) -> IntCheckpoint:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _refuse(f"GPTQ bits {bits!r}")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    fmt = "marlin" if qc.get("is_marlin_format") else fmt
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"GPTQ checkpoint_format {fmt!r} (a repacked kernel layout)")
    if qc.get("dynamic"):
        raise _refuse("GPTQ per-module 'dynamic' overrides")
    if qc.get("lm_head"):
        raise _refuse("GPTQ lm_head true (a quantized LM head)")
    act_order = bool(qc.get("desc_act", False))
    return IntCheckpoint(
        "gptq",
        int(bits),
        _group(qc.get("group_size", 128), "GPTQ"),
        symmetric=bool(qc.get("sym", True)),
        act_order=act_order,
        zeros_offset=1 if fmt == "gptq" else 0,
        ignore=tuple(qc.get("modules_to_not_convert") or ()),
    )


def _pack_quantized(qc: dict[str, Any]) -> IntCheckpoint:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _refuse("compressed-tensors pack-quantized without config_groups")
    schemes, targets = set(), []
    for group in groups:
        weights = group.get("weights") or {}
        if weights.get("type") != "int" or weights.get("num_bits") not in (4, 8):
            raise _refuse(
                f"compressed-tensors pack-quantized weights {weights.get('type')}/"
                f"{weights.get('num_bits')} bits"
            )
        if not weights.get("symmetric", True):
            raise _refuse("compressed-tensors pack-quantized asymmetric weights (zero points)")
        if weights.get("dynamic"):
            raise _refuse("compressed-tensors dynamic weight quantization")
        strategy = weights.get("strategy", "group")
        if strategy not in ("group", "channel"):
            raise _refuse(f"compressed-tensors int weight strategy {strategy!r}")
        actorder = weights.get("actorder")
        if actorder not in (None, False, "weight", "group", "static", "dynamic"):
            raise _refuse(f"compressed-tensors actorder {actorder!r}")
        if actorder == "dynamic":
            raise _refuse("compressed-tensors actorder 'dynamic'")
        if group.get("input_activations") or group.get("output_activations"):
            raise _refuse("compressed-tensors int weights with quantized activations (w4a8/w8a8)")
        size = -1 if strategy == "channel" else _group(weights.get("group_size"), "CT")
        schemes.add((int(weights["num_bits"]), size, actorder == "group"))
        targets.extend(group.get("targets") or ["Linear"])
    if len(schemes) > 1:
        raise _refuse(f"a compressed-tensors checkpoint mixing int schemes {sorted(schemes)}")
    bits, size, act_order = schemes.pop()
    return IntCheckpoint(
        "compressed-tensors",
        bits,
        size,
        symmetric=True,
        act_order=act_order,
        ignore=tuple(qc.get("ignore") or ()),
        targets=tuple(targets),
    )
