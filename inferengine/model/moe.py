"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE): Llama-style layers whose MLP is a sparse
block of top-k experts (`layers/moe.py`), and the per-layer count of tokens each expert got.

Checkpoint names: per-expert tensors as the hub's checkpoints (and Transformers 5's
save_pretrained) write them, `block_sparse_moe.experts.N.w1|w2|w3` (Mixtral) and
`mlp.experts.N.gate_proj|up_proj|down_proj` (Qwen3-MoE), or the fused 3-D
`mlp.experts.gate_up_proj` / `mlp.experts.down_proj` of Transformers 5's modules.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from inferengine.attention.metadata import AttentionMetadata
from inferengine.errors import ModelLoadError
from inferengine.model.layers.moe import DOWN, GATE, UP, SparseMoeBlock
from inferengine.model.llama import DecoderLayer, LlamaForCausalLM, ModelInit

_EXPERT = re.compile(
    r"^(?P<layer>.+)\.(?:block_sparse_moe|mlp)\.experts\.(?P<expert>\d+)\."
    r"(?P<part>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_PARTS = {"w1": GATE, "gate_proj": GATE, "w3": UP, "up_proj": UP, "w2": DOWN, "down_proj": DOWN}


def route_expert_weight(name: str) -> tuple[str, Any] | None:
    """A per-expert checkpoint tensor → (our stacked parameter, (expert, part)); else None."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    part = _PARTS[m["part"]]
    target = "down_proj" if part == DOWN else "gate_up_proj"
    return f"{m['layer']}.mlp.experts.{target}", (int(m["expert"]), part)


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is a `SparseMoeBlock` (given the step's slot mapping, so that
    padding tokens are left out of the expert counts)."""

    def feed_forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.mlp(hidden, metadata.slot_mapping)


class MoeForCausalLM(LlamaForCausalLM):
    """Shared by the mixture-of-experts families; subclasses say which layers are sparse and
    how their router renormalises."""

    weights_in_input_dtype = False

    def renormalize(self, c: dict[str, Any]) -> bool:
        return True

    def num_experts(self, c: dict[str, Any]) -> int:
        return int(c.get("num_local_experts") or c.get("num_experts") or 0)

    def expert_intermediate_size(self, c: dict[str, Any]) -> int:
        return int(c["intermediate_size"])

    def is_sparse(self, index: int, c: dict[str, Any]) -> bool:
        return True

    def decoder_layer(self, index: int, init: ModelInit) -> nn.Module:
        c = init.hf_config
        if not self.is_sparse(index, c):
            return super().decoder_layer(index, init)
        prefix = f"model.layers.{index}"
        block = SparseMoeBlock(
            self.spec.hidden_size,
            self.num_experts(c),
            int(c["num_experts_per_tok"]),
            self.expert_intermediate_size(c),
            renormalize=self.renormalize(c),
            weights_in_input_dtype=self.weights_in_input_dtype,
            quant_config=init.quant_config,
            prefix=f"{prefix}.mlp",
        )
        return MoeDecoderLayer(
            self.spec, c, init.attn_backend, block, quant_config=init.quant_config, prefix=prefix
        )

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """This pipeline stage's sparse blocks by layer index."""
        return {
            i: layer.mlp
            for i, layer in enumerate(self.model.layers)
            if isinstance(getattr(layer, "mlp", None), SparseMoeBlock)
        }

    def expert_token_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert of each sparse layer since the last reset (one read of
        the device counters)."""
        blocks = self.moe_blocks()
        if not blocks:
            return {}
        rows = torch.stack([b.expert_tokens[:-1] for b in blocks.values()]).tolist()
        return dict(zip(blocks, rows, strict=True))

    def reset_expert_token_counts(self) -> None:
        for block in self.moe_blocks().values():
            block.expert_tokens.zero_()

    def route_weight(self, name: str) -> tuple[str, Any] | None:
        return route_expert_weight(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((n.replace(".block_sparse_moe.", ".mlp."), t) for n, t in weights)
        for index, block in self.moe_blocks().items():
            missing = block.experts.missing_parts()
            if missing:
                shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
                raise ModelLoadError(
                    f"the checkpoint lacks expert weights of layer {index} ({shown}); the "
                    "download is incomplete or belongs to another model."
                )


class MixtralForCausalLM(MoeForCausalLM):
    """Every layer sparse; the top-k weights are a softmax over the chosen logits."""


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """q/k norm like Qwen3; dense layers where Transformers puts them (`mlp_only_layers`,
    `decoder_sparse_step`); top-k weights renormalised only with `norm_topk_prob`."""

    qk_norm = True
    weights_in_input_dtype = True

    def renormalize(self, c: dict[str, Any]) -> bool:
        return bool(c.get("norm_topk_prob", False))

    def expert_intermediate_size(self, c: dict[str, Any]) -> int:
        return int(c["moe_intermediate_size"])

    def is_sparse(self, index: int, c: dict[str, Any]) -> bool:
        step = int(c.get("decoder_sparse_step") or 1)
        dense = c.get("mlp_only_layers") or []
        return index not in dense and self.num_experts(c) > 0 and (index + 1) % step == 0
