"""`LoRARequest`: which adapter a request runs with (vLLM's spelling); it crosses the core boundary."""

from __future__ import annotations

from collections.abc import Iterable

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


class LoRAStats(msgspec.Struct, omit_defaults=True):
    """Adapters of the running and the waiting requests (names, sorted), for vLLM's
    `lora_requests_info` gauge."""

    max_lora: int
    running: list[str] = []
    waiting: list[str] = []


def lora_stats(running: Iterable, waiting: Iterable, max_loras: int) -> LoRAStats | None:
    """The scheduler's adapter stats (None with LoRA off)."""
    if max_loras <= 0:
        return None

    def names(requests: Iterable) -> list[str]:
        return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})

    return LoRAStats(max_loras, names(running), names(waiting))
