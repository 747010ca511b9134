"""Multi-LoRA on the worker: adapter slots on the device (LRU over a host pool) and the linear-layer wrapper."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from inferengine.config import EngineConfig
from inferengine.core.sched_output import SchedulerOutput
from inferengine.distributed.parallel_state import get_tp_rank
from inferengine.errors import ConfigError
from inferengine.kernels.lora import lora_expand_ref, lora_shrink_ref
from inferengine.logger import init_logger
from inferengine.lora.peft import SUPPORTED_TARGETS, AdapterSpec, check_adapter
from inferengine.lora.request import LoRARequest
from inferengine.model.layers.linear import RowParallelLinear
from inferengine.model.quantization.base import checkpoint_modules

logger = init_logger(__name__)


@dataclass
class LoRAStep:
    """What every wrapped layer reads in a step: each token's slot (None: no adapter in the
    step, the base alone runs) and each slot's scale."""

    scales: torch.Tensor
    token_slots: torch.Tensor | None = None


@dataclass
class LoRASlice:
    """One projection's stacked adapters inside a (possibly fused) layer: A [S, R, in] and
    B [S, out, R] for this rank, written into output columns [offset, offset + out)."""

    a: torch.Tensor
    b: torch.Tensor
    offset: int


class LoRALinearMethod:
    """Wraps a layer's `quant_method` (any format: it calls the method's own `apply`) and adds
    scale · (x Aᵀ) Bᵀ per token with that token's adapter. It does not pass on
    `takes_fp8_input`, so the layer gets its input unquantized, which the LoRA path needs."""

    def __init__(self, base, step: LoRAStep, slices: list[LoRASlice]):
        self.base = base
        self.step = step
        self.slices = slices

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int]) -> None:
        self.base.create_weights(layer, input_size, output_sizes)

    def process_after_loading(self, layer: nn.Module) -> None:
        self.base.process_after_loading(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.base.apply(layer, x, bias)
        slots = self.step.token_slots
        if slots is None:
            return y
        flat_x, flat_y = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        if flat_x.shape[0] != slots.shape[0]:
            raise RuntimeError(
                f"LoRA: {flat_x.shape[0]} tokens in the layer, {slots.shape[0]} token slots set"
            )
        for s in self.slices:
            shrunk = lora_shrink_ref(flat_x, s.a, slots)
            lora_expand_ref(flat_y, shrunk, s.b, slots, self.step.scales, s.offset)
        return y


@dataclass
class _Target:
    layer: nn.Module
    slice: LoRASlice
    shard_id: int | str | None


@dataclass
class _Loaded:
    spec: AdapterSpec
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class LoRASlots:
    """`max_loras` device slots, filled from a host pool of up to `max_cpu_loras` loaded
    adapters (each LRU), and each step's per-token slot indices."""

    def __init__(
        self,
        config: EngineConfig,
        model: nn.Module,
        device: torch.device,
        live: Mapping[str, object],
    ):
        """`live`: the runner's requests (those it holds state for)."""
        lora = config.lora_config
        assert lora is not None
        self.hf_config = config.model_config.hf_config
        self.max_loras, self.max_rank = lora.max_loras, lora.max_lora_rank
        self.max_cpu_loras = lora.max_cpu_loras or lora.max_loras
        self.device = device
        self.dtype = next(model.parameters()).dtype
        self.step = LoRAStep(scales=torch.zeros(self.max_loras, device=device))
        self.targets: dict[str, _Target] = {}
        stacked = getattr(model, "stacked_params", ())
        for module in model.modules():
            if hasattr(module, "quant_method") and hasattr(module, "output_sizes"):
                self._wrap(module, stacked)
        if not self.targets:
            raise ConfigError(
                "--enable-lora needs a natively built model (Llama, Mistral, Qwen2/3, Gemma "
                "...); this one runs through the Transformers fallback or has no linear layers."
            )
        self.host: OrderedDict[int, _Loaded] = OrderedDict()  # adapter id -> tensors (LRU)
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot (LRU)
        self.requests: dict[str, LoRARequest | None] = {}
        self.num_installs = 0  # adapters copied into a slot (swaps included)
        self.live = live

    def _wrap(self, layer: nn.Module, stacked) -> None:
        names = checkpoint_modules(layer.prefix, stacked, len(layer.output_sizes))
        if not names or any(n.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS for n in names):
            return
        in_features = layer.input_size
        slices, offset = [], 0
        for part, (name, out_features) in enumerate(zip(names, layer.output_sizes, strict=True)):
            a = torch.zeros(self.max_loras, self.max_rank, in_features, dtype=self.dtype)
            b = torch.zeros(self.max_loras, out_features, self.max_rank, dtype=self.dtype)
            s = LoRASlice(a.to(self.device), b.to(self.device), offset)
            slices.append(s)
            shard_id = None if isinstance(layer, RowParallelLinear) else part
            self.targets[name] = _Target(layer, s, shard_id)
            offset += out_features
        layer.quant_method = LoRALinearMethod(layer.quant_method, self.step, slices)

    # ---- adapters ------------------------------------------------------------------------

    def _host_copy(self, lora: LoRARequest) -> _Loaded:
        loaded = self.host.get(lora.lora_int_id)
        if loaded is not None:
            self.host.move_to_end(lora.lora_int_id)
            return loaded
        spec = check_adapter(lora.lora_path, self.hf_config, self.max_rank)
        tensors = load_file(str(spec.weights_file))
        loaded = _Loaded(spec, tensors)
        while len(self.host) >= self.max_cpu_loras:
            self.host.popitem(last=False)
        self.host[lora.lora_int_id] = loaded
        logger.info("LoRA %s (id %d) loaded from %s", lora.lora_name, lora.lora_int_id, spec.path)
        return loaded

    def _install(self, slot: int, loaded: _Loaded) -> None:
        for target in self.targets.values():
            target.slice.a[slot].zero_()
            target.slice.b[slot].zero_()
        spec, rank = loaded.spec, loaded.spec.rank
        for name, (a_key, b_key) in spec.modules.items():
            target = self.targets.get(name)
            if target is None:
                raise ConfigError(f"LoRA {spec.path}: the model has no layer {name}")
            a, b = loaded.tensors[a_key], loaded.tensors[b_key]
            if target.shard_id is None:  # row-parallel: this rank's input columns of A
                cols = target.layer.input_size
                a = a[:, get_tp_rank() * cols : (get_tp_rank() + 1) * cols]
            else:  # column-parallel: this rank's output rows of B
                place = target.layer.placement(target.shard_id)
                b = b[place.first_row : place.first_row + place.rows]
            target.slice.a[slot, :rank].copy_(a)
            target.slice.b[slot, :, :rank].copy_(b)
        self.step.scales[slot] = spec.scale
        self.num_installs += 1

    def _slot_for(self, lora: LoRARequest, in_use: set[int]) -> int:
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(lora.lora_int_id)
            return slot
        loaded = self._host_copy(lora)
        if len(self.slot_of) < self.max_loras:
            slot = len(self.slot_of)
        else:
            victim = next(i for i in self.slot_of if i not in in_use)
            slot = self.slot_of.pop(victim)
        self._install(slot, loaded)
        self.slot_of[lora.lora_int_id] = slot
        return slot

    # ---- one step ------------------------------------------------------------------------

    def prepare(
        self, so: SchedulerOutput, req_ids: list[str], num_scheduled: list[int], graph_shape
    ) -> None:
        """Set the slot of each of the step's tokens (padding up to `graph_shape`'s tokens:
        −1), installing the adapters it needs (the scheduler lets at most `max_loras` run)."""
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.requests[new.req_id] = new.lora_request
        if len(self.requests) > 2 * len(self.live) + 64:  # ends that came in empty steps
            self.requests = {r: lora for r, lora in self.requests.items() if r in self.live}
        loras = [self.requests.get(r) for r in req_ids]
        if all(lora is None for lora in loras):
            self.step.token_slots = None
            return
        wanted = {lora.lora_int_id for lora in loras if lora is not None}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in a step; --max-loras is {self.max_loras}")
        slots = [-1 if lora is None else self._slot_for(lora, wanted) for lora in loras]
        num_tokens = graph_shape.num_tokens if graph_shape is not None else sum(num_scheduled)
        per_token = np.full(num_tokens, -1, dtype=np.int64)
        real = np.repeat(np.asarray(slots, dtype=np.int64), num_scheduled)
        per_token[: real.shape[0]] = real
        self.step.token_slots = torch.from_numpy(per_token).to(self.device, non_blocking=True)
