"""Multi-LoRA: adapter requests, PEFT folder checks and the scheduler's per-step adapter cap."""

from inferengine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
