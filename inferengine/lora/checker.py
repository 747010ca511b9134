"""The API side's adapter check: each `LoRARequest` is checked against the base once, before it is queued."""

from __future__ import annotations

from typing import Any

from inferengine.config import EngineConfig
from inferengine.lora.peft import AdapterSpec, LoRAError, check_adapter
from inferengine.lora.request import LoRARequest


class AdapterChecker:
    """Checks adapters against the base model's shapes and --max-lora-rank (cached per id and
    path), so a bad folder is a 400 at the request, never a failed step in the worker."""

    def __init__(self, hf_config: dict[str, Any], max_rank: int):
        self.hf_config = hf_config
        self.max_rank = max_rank
        self._checked: dict[tuple[int, str], AdapterSpec] = {}
        self._paths: dict[int, str] = {}  # id -> the one folder it names

    def check(self, lora: LoRARequest) -> AdapterSpec:
        key = (lora.lora_int_id, lora.lora_path)
        spec = self._checked.get(key)
        if spec is None:
            other = self._paths.get(lora.lora_int_id)
            if other is not None and other != lora.lora_path:
                raise LoRAError(
                    f"lora_int_id {lora.lora_int_id} already names the adapter at {other!r}; "
                    f"give {lora.lora_path!r} its own id (ids key the adapter slots and the "
                    "prefix cache)."
                )
            spec = check_adapter(lora.lora_path, self.hf_config, self.max_rank)
            self._checked[key] = spec
            self._paths[lora.lora_int_id] = lora.lora_path
        return spec


def adapter_checker(config: EngineConfig) -> AdapterChecker | None:
    """The checker of an engine started with LoRA on; None without."""
    lora = config.lora_config
    if lora is None:
        return None
    return AdapterChecker(config.model_config.hf_config, lora.max_lora_rank)


def check_lora_request(checker: AdapterChecker | None, lora: LoRARequest) -> AdapterSpec:
    """Raise `LoRAError` unless LoRA is on and `lora`'s folder fits the base."""
    if checker is None:
        raise LoRAError(
            f"the request asks for LoRA adapter {lora.lora_name!r}, and this engine was started "
            "without LoRA: start it with enable_lora=True (--enable-lora)."
        )
    return checker.check(lora)
