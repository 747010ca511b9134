"""`LoRARequest`: which adapter a request runs with (vLLM's spelling); it crosses the core boundary."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """An adapter: `lora_name` (the API's model name), `lora_int_id` (≥ 1, unique per adapter:
    the slot pool and the prefix cache key on it) and `lora_path`, a PEFT folder the worker
    loads from."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1, got {self.lora_int_id}")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


def adapter_id(lora: LoRARequest | None) -> int | None:
    """The adapter's id, None for the base model."""
    return None if lora is None else lora.lora_int_id


def admits_adapter(lora: LoRARequest | None, running: list, max_loras: int) -> bool:
    """The scheduler's cap: may a request with `lora` join `running` (requests with a
    `lora_request`) without more than `max_loras` distinct adapters running at once?"""
    if lora is None or max_loras <= 0:
        return True
    active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
    return lora.lora_int_id in active or len(active) < max_loras
