"""The server's adapters by name: `--lora-modules` at start, runtime loads and unloads, ids handed out once."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from inferengine.errors import ConfigError, InvalidRequestError, ModelNotFoundError
from inferengine.lora.peft import check_adapter
from inferengine.lora.request import LoRARequest


@dataclass(frozen=True, slots=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name": ...}`."""
    text = value.strip()
    if text.startswith("{"):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--lora-modules {value!r} is not valid JSON ({e}).") from e
        if not isinstance(item, dict) or not item.get("name") or not item.get("path"):
            raise ConfigError(f"--lora-modules {value!r}: the JSON form needs name and path.")
        return LoRAModule(item["name"], item["path"], item.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ConfigError(f"--lora-modules takes name=path (or JSON); got {value!r}.")
    return LoRAModule(name, path)


class LoRARegistry:
    """Adapters a server offers, by the name clients send as `model`. Every load gets a fresh
    id, so an adapter loaded again under an old name never reuses the old one's KV or slot."""

    def __init__(self, hf_config: dict[str, Any], max_rank: int, base_name: str):
        self.hf_config = hf_config
        self.max_rank = max_rank
        self.base_name = base_name
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the folder against the base (raises `LoRAError`) and offer it as `name`."""
        if not name or not path:
            raise InvalidRequestError("lora_name and lora_path are both required.")
        if name in self._by_name or name == self.base_name:
            raise InvalidRequestError(
                f"the name {name!r} is already served; unload it first or pick another.",
                param="lora_name",
            )
        check_adapter(path, self.hf_config, self.max_rank)
        lora = LoRARequest(name, next(self._ids), path, base_model_name or self.base_name)
        self._by_name[name] = lora
        return lora

    def remove(self, name: str) -> LoRARequest:
        lora = self._by_name.pop(name, None)
        if lora is None:
            raise ModelNotFoundError(
                f"no LoRA adapter named {name!r} is loaded.",
                param="lora_name",
                code="model_not_found",
            )
        return lora

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self._by_name.get(name)

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)
