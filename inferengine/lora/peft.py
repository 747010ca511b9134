"""PEFT LoRA folders: read `adapter_config.json` and the safetensors header, refuse what we do not run."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferengine.errors import InvalidRequestError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SUPPORTED_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$"
)
_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<name>\w+)$")


class LoRAError(InvalidRequestError):
    """An adapter this engine cannot load (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A checked adapter: `modules` maps a checkpoint module name
    (`model.layers.0.self_attn.q_proj`) to the keys of its A and B tensors in the weights file;
    `scale` multiplies x Aᵀ Bᵀ (lora_alpha / r, or / √r with rsLoRA)."""

    path: Path
    rank: int
    scale: float
    modules: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def weights_file(self) -> Path:
        return self.path / WEIGHTS_FILE


def module_shapes(hf_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) features of each supported target in the base model."""
    hidden = hf_config["hidden_size"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    inter = hf_config.get("intermediate_size", 0)
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv_heads * head_dim, hidden),
        "v_proj": (kv_heads * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Tensor name -> {"dtype", "shape", ...} from a safetensors file's header (no tensor read)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def read_config(path: Path) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, with its files checked."""
    if not path.is_dir():
        raise LoRAError(f"LoRA adapter folder {str(path)!r} does not exist.")
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE} (a PEFT folder has one).")
    if not (path / WEIGHTS_FILE).is_file():
        other = " (it has adapter_model.bin: save it with safe_serialization)" * (
            (path / "adapter_model.bin").is_file()
        )
        raise LoRAError(f"LoRA adapter {str(path)!r} has no {WEIGHTS_FILE}{other}.")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise LoRAError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not JSON ({e}).") from e


def _refuse_unsupported(config: dict[str, Any], where: str) -> None:
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{where}: peft_type {config.get('peft_type')!r}; only LORA adapters run.")
    refused = {
        "modules_to_save": "modules_to_save (fully fine-tuned modules, e.g. lm_head)",
        "use_dora": "DoRA (use_dora)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D bases)",
        "layer_replication": "layer_replication",
    }
    for key, what in refused.items():
        if config.get(key):
            raise LoRAError(f"{where}: {what} is not supported; only plain LoRA runs.")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias {config['bias']!r} is not supported (only 'none').")


def check_adapter(path: str | Path, hf_config: dict[str, Any], max_rank: int) -> AdapterSpec:
    """Check a PEFT folder against the base model (`hf_config`) and `max_rank`; raise `LoRAError`
    saying what is wrong (missing files, another base, rank over the limit, other targets)."""
    path = Path(path)
    where = f"LoRA adapter {str(path)!r}"
    config = read_config(path)
    _refuse_unsupported(config, where)
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if rank > max_rank:
        raise LoRAError(
            f"{where} has rank {rank}, over --max-lora-rank {max_rank}; start the engine with "
            f"--max-lora-rank {rank} or more (at most 256)."
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    header = read_safetensors_header(path / WEIGHTS_FILE)
    shapes = module_shapes(hf_config)
    num_layers = hf_config["num_hidden_layers"]
    moe = bool(hf_config.get("num_experts") or hf_config.get("num_local_experts"))
    pairs: dict[str, dict[str, str]] = {}
    for key in header:
        m = _KEY.match(key)
        module = _MODULE.match(m["module"]) if m else None
        if module is None or module["name"] not in SUPPORTED_TARGETS:
            raise LoRAError(
                f"{where} adapts {key!r}; supported targets are the decoder layers' "
                f"{', '.join(SUPPORTED_TARGETS)} (no embeddings, LM head or other modules)."
            )
        if int(module["layer"]) >= num_layers:
            raise LoRAError(f"{where} adapts layer {module['layer']}; the base has {num_layers}.")
        if moe and module["block"] == "mlp":
            raise LoRAError(
                f"{where} adapts {key!r}: LoRA on mixture-of-experts MLPs is not built."
            )
        pairs.setdefault(m["module"], {})[m["ab"]] = key
    if not pairs:
        raise LoRAError(f"{where} holds no LoRA tensors.")
    modules: dict[str, tuple[str, str]] = {}
    for name, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"{where}: {name} has lora_{next(iter(ab))} but not both A and B.")
        out_features, in_features = shapes[name.rsplit(".", 1)[1]]
        a_shape, b_shape = header[ab["A"]]["shape"], header[ab["B"]]["shape"]
        if a_shape != [rank, in_features] or b_shape != [out_features, rank]:
            raise LoRAError(
                f"{where} does not fit this base model: {name} has A {a_shape} and B "
                f"{b_shape}, the base needs A [{rank}, {in_features}] and B "
                f"[{out_features}, {rank}] (was it trained on another model?)."
            )
        modules[name] = (ab["A"], ab["B"])
    return AdapterSpec(path, rank, scale, modules)
