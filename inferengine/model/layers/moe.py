"""Sparse mixture-of-experts block: a router, top-k experts (SwiGLU MLPs) and a count of the
tokens each expert received.

Tensor parallel like the dense MLP: every rank holds every expert, with the intermediate
dimension split (gate/up rows column-parallel, down columns row-parallel) and one all-reduce of
the block's output. The router is replicated, so every rank routes alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from inferengine.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from inferengine.kernels.fused_moe import fused_moe_ref, select_experts
from inferengine.model.layers.fused import use_fused_kernels
from inferengine.model.layers.linear import default_weight_loader, linear, shape_of
from inferengine.model.quantization.base import join_prefix

if TYPE_CHECKING:
    from inferengine.model.quantization.base import QuantizationConfig

# Expert shard ids: which half of gate_up_proj a per-expert tensor fills (down has one part).
GATE, UP, DOWN = 0, 1, 2


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Router(nn.Module):
    """Replicated router linear, hidden → expert logits (`mlp.gate.weight` in checkpoints)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.weight = _param(num_experts, hidden_size)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class UnquantizedExpertsMethod:
    """Experts' weights in the model's dtype, run by the fused-experts kernel (its torch
    reference off CUDA). The experts' `quant_method`: a quantized format (FP8 experts, say)
    would create its own stacked weights and scales here and run a kernel that takes them."""

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int, shard: int
    ) -> None:
        layer.gate_up_proj = _param(num_experts, 2 * shard, hidden_size)
        layer.down_proj = _param(num_experts, hidden_size, shard)
        layer.gate_up_proj.weight_loader = layer.weight_loader
        layer.down_proj.weight_loader = layer.weight_loader

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if use_fused_kernels(x):
            from inferengine.kernels.fused_moe import fused_moe

            return fused_moe(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids)
        return fused_moe_ref(x, layer.gate_up_proj, layer.down_proj, topk_weights, topk_ids)

    def process_after_loading(self, layer: nn.Module) -> None:
        pass


class FusedExperts(nn.Module):
    """All experts' weights stacked: gate_up_proj [E, 2·I/tp, H] (this rank's gate rows, then
    its up rows) and down_proj [E, H, I/tp], in Transformers 5's fused layout and names.

    Loads either the fused tensors (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
    [E, H, I]) or per-expert ones with shard id `(expert, GATE | UP | DOWN)`. Its weights'
    format is the `quant_config`'s `experts_method` (unquantized: the only one there is yet).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        tp = get_tp_size()
        if intermediate_size % tp:
            raise ValueError(
                f"expert intermediate size {intermediate_size} is not divisible by tensor "
                f"parallel size {tp}"
            )
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.shard = intermediate_size // tp
        self.prefix = prefix
        method = None if quant_config is None else quant_config.experts_method(self, prefix)
        self.quant_method = UnquantizedExpertsMethod() if method is None else method
        self.quant_method.create_weights(self, num_experts, hidden_size, self.shard)
        # (expert, part) filled so far, part GATE, UP or DOWN: a load must fill them all.
        self.loaded_parts: set[tuple[int, int]] = set()

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """Copy this rank's slice of a fused tensor (shard_id None) or of one expert's."""
        first = get_tp_rank() * self.shard
        size, full = self.shard, self.intermediate_size
        is_down = param is self.down_proj
        name = "down_proj" if is_down else "gate_up_proj"
        num_experts, rows, cols = param.shape
        if shard_id is None:
            shape = shape_of(loaded)
            want = (num_experts, rows, full) if is_down else (num_experts, 2 * full, cols)
            if shape != want:
                raise ValueError(f"shape mismatch: {name} {want}, checkpoint {shape}")
            if is_down:
                param.data.copy_(loaded[:, :, first : first + size])
            else:
                param.data[:, :size].copy_(loaded[:, first : first + size])
                param.data[:, size:].copy_(loaded[:, full + first : full + first + size])
            parts = (DOWN,) if is_down else (GATE, UP)
            self.loaded_parts.update((e, p) for e in range(self.num_experts) for p in parts)
            return
        expert, part = shard_id
        if not 0 <= expert < num_experts:
            raise ValueError(f"expert {expert} is past the config's {num_experts} experts")
        shape = shape_of(loaded)
        want = (rows, full) if is_down else (full, cols)
        if shape != want:
            raise ValueError(f"shape mismatch: expert {name} part {want}, checkpoint {shape}")
        if is_down:
            param.data[expert].copy_(loaded[:, first : first + size])
        else:
            param.data[expert, part * size : (part + 1) * size].copy_(loaded[first : first + size])
        self.loaded_parts.add((expert, part))

    def missing_parts(self) -> list[str]:
        """Expert weights no checkpoint tensor filled, e.g. "expert 3 up"."""
        names = {GATE: "gate", UP: "up", DOWN: "down"}
        return [
            f"expert {e} {names[p]}"
            for e in range(self.num_experts)
            for p in (GATE, UP, DOWN)
            if (e, p) not in self.loaded_parts
        ]

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's partial sum of the chosen experts' outputs (not yet all-reduced)."""
        return self.quant_method.apply(self, x, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """router → softmax → top-k (renormalised or not) → experts → all-reduce.

    `expert_tokens` counts, on the device, the (token, expert) pairs routed to each expert
    since the last reset; padding tokens of a padded step (slot −1) are not counted. Reading it
    is the only host sync, and happens when metrics are collected.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        weights_in_input_dtype: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.top_k = top_k
        self.num_experts = num_experts
        self.renormalize = renormalize
        # Qwen3-MoE rounds the routing weights to the hidden dtype, Mixtral keeps float32.
        self.weights_in_input_dtype = weights_in_input_dtype
        self.gate = Router(hidden_size, num_experts)
        # The router stays unquantized in every format (as in vLLM); the experts ask the config.
        self.experts = FusedExperts(
            num_experts,
            hidden_size,
            intermediate_size,
            quant_config,
            join_prefix(prefix, "experts"),
        )
        # The last bin takes padding tokens.
        counts = torch.zeros(num_experts + 1, dtype=torch.int64)
        self.register_buffer("expert_tokens", counts, persistent=False)

    def forward(self, x: torch.Tensor, slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.gate(x)
        if use_fused_kernels(logits):
            from inferengine.kernels.fused_moe import route

            weights, ids = route(logits, self.top_k, self.renormalize)
        else:
            weights, ids = select_experts(logits, self.top_k, self.renormalize)
        if self.weights_in_input_dtype:
            weights = weights.to(x.dtype)
        self.count_tokens(ids, slot_mapping)
        return tp_all_reduce(self.experts(x, weights, ids))

    def count_tokens(self, ids: torch.Tensor, slot_mapping: torch.Tensor | None) -> None:
        if slot_mapping is not None:
            real = slot_mapping[: ids.shape[0], None] >= 0
            ids = torch.where(real, ids, self.num_experts)
        ids = ids.reshape(-1)
        self.expert_tokens.index_add_(0, ids, torch.ones_like(ids))
