"""Multi-LoRA on the server: the adapters by name, their model cards, and vLLM's load/unload routes."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel

from inferengine.config import EngineConfig
from inferengine.entrypoints.openai.protocol import ModelCard
from inferengine.errors import ConfigError, InferEngineError, ModelNotFoundError
from inferengine.lora.registry import LoRARegistry, parse_lora_module

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field, accepted; the name decides


def server_loras(engine_config: EngineConfig, lora_modules: list[str]) -> LoRARegistry | None:
    """The adapters `--lora-modules` names, each checked against the base now; None when the
    engine runs without --enable-lora (refused if adapters were named)."""
    lora = engine_config.lora_config
    if lora is None:
        if lora_modules:
            raise ConfigError("--lora-modules needs --enable-lora.")
        return None
    mc = engine_config.model_config
    registry = LoRARegistry(mc.hf_config, lora.max_lora_rank, mc.name)
    for value in lora_modules:
        module = parse_lora_module(value)
        try:
            registry.add(module.name, module.path, module.base_model_name)
        except InferEngineError as e:
            raise ConfigError(f"--lora-modules {module.name}: {e.message}") from e
    return registry


def adapter_cards(registry: LoRARegistry | None, created: int) -> list[ModelCard]:
    """One card per adapter, its `parent` the base model (as vLLM lists them)."""
    if registry is None:
        return []
    return [
        ModelCard(
            id=lora.lora_name, created=created, root=lora.lora_path, parent=lora.base_model_name
        )
        for lora in registry
    ]


def _registry(request: Request) -> LoRARegistry:
    state = request.app.state.server
    lora = state.engine_config.lora_config
    if lora is None or not lora.runtime_updates:
        raise ModelNotFoundError(
            "loading and unloading LoRA adapters at runtime is off: start the server with "
            "--enable-lora --enable-runtime-lora (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING).",
            code="runtime_lora_disabled",
        )
    return state.loras


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    _registry(request).add(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    _registry(request).remove(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
