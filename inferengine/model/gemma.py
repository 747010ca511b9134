"""Gemma 2 and Gemma 3 (text) decoders, on the Llama module's parallel layers and weight loading.

What sets them apart from Llama, each as Transformers computes it: embeddings scaled by
sqrt(hidden_size) in the model dtype; RMSNorm by (1 + w), rounded once after the multiply; a
GELU-tanh gated MLP; four norms per layer (post-attention and pre/post-feedforward besides the
input norm); queries scaled by query_pre_attn_scalar^-0.5; sliding-window layers interleaved
with global ones. Gemma 2 soft-caps attention and final logits; Gemma 3 norms q and k per head
and gives local layers a rope base of their own (global layers take the rope scaling).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from inferengine.attention.backends.base import AttentionBackend
from inferengine.attention.metadata import AttentionMetadata
from inferengine.distributed.parallel_state import (
    is_last_stage,
    pp_layer_range,
)
from inferengine.errors import ModelLoadError
from inferengine.model.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from inferengine.model.layers.rotary import RotaryEmbedding
from inferengine.model.layers.vocab import ParallelLMHead
from inferengine.model.llama import (
    DecoderAttention,
    DecoderModel,
    DecoderSpec,
    LlamaForCausalLM,
    ModelInit,
    attend,
)
from inferengine.model.quantization.base import join_prefix

if TYPE_CHECKING:
    from inferengine.model.quantization.base import QuantizationConfig

SLIDING, FULL = "sliding_attention", "full_attention"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True)
class GemmaSpec:
    """What a Gemma config adds to `DecoderSpec`."""

    query_pre_attn_scalar: float
    attn_soft_cap: float | None
    final_soft_cap: float | None
    layer_types: tuple[str, ...]  # SLIDING or FULL, per layer
    # Per layer type, the config dict `RotaryEmbedding` reads its rope parameters from.
    rope_configs: dict[str, dict[str, Any]]

    @classmethod
    def from_hf(cls, c: dict[str, Any], version: int) -> GemmaSpec:
        act = c.get("hidden_activation") or c.get("hidden_act") or GELU_TANH[0]
        if act not in GELU_TANH:
            raise ModelLoadError(
                f"Gemma with hidden_activation {act!r} is not supported (Gemma uses "
                f"{GELU_TANH[0]!r}); is config.json the model's own?"
            )
        if c.get("use_bidirectional_attention"):
            raise ModelLoadError(
                "this Gemma config sets use_bidirectional_attention (an embedding model such as "
                "EmbeddingGemma); InferEngine serves causal language models only."
            )
        return cls(
            query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or 256),
            # Transformers' Gemma 3 attention takes no soft cap, whatever its config says.
            attn_soft_cap=c.get("attn_logit_softcapping") if version == 2 else None,
            final_soft_cap=c.get("final_logit_softcapping"),
            layer_types=_layer_types(c, default_pattern=2 if version == 2 else 6),
            rope_configs=_rope_configs(c) if version == 3 else {SLIDING: c, FULL: c},
        )


def _layer_types(c: dict[str, Any], default_pattern: int) -> tuple[str, ...]:
    """`layer_types`, or for older configs every `sliding_window_pattern`-th layer global."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if types is None:
        pattern = int(c.get("sliding_window_pattern") or default_pattern)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    if len(types) != n or not set(types) <= {SLIDING, FULL}:
        raise ModelLoadError(
            f"config.json's layer_types must list {n} entries of {SLIDING!r} or {FULL!r}; "
            f"got {types!r}."
        )
    return tuple(types)


def _rope_configs(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Gemma 3's rope per layer type: from `rope_parameters` keyed by layer type (Transformers 5),
    or from `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq` (local)."""
    params = c.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full = {**params, **(c.get("rope_scaling") or {})}
        full.setdefault("rope_theta", c.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": c.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10_000.0)
    return {FULL: {"rope_parameters": full}, SLIDING: {"rope_parameters": local}}


class GemmaRMSNorm(nn.Module):
    """x / rms(x) · (1 + w) in float32, rounded to x's dtype once (Llama rounds before the
    multiply); with a residual, `(norm(x + residual), x + residual)` like `RMSNorm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaMLP(nn.Module):
    def __init__(
        self, spec: DecoderSpec, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ):
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, [size, size], False, quant_config, join_prefix(prefix, "gate_up_proj")
        )
        self.down_proj = RowParallelLinear(
            size, spec.hidden_size, False, quant_config, join_prefix(prefix, "down_proj")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Transformers adds each sublayer's post-normed output to the stream; here the stream is
    carried as (hidden, residual) like Llama's layers, which adds the same floats in the same
    pairs: the next norm's residual form does the add."""

    def __init__(
        self,
        spec: DecoderSpec,
        gemma: GemmaSpec,
        layer_type: str,
        rotary_emb: RotaryEmbedding,
        backend: AttentionBackend,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        window = spec.sliding_window if layer_type == SLIDING else None
        self.self_attn = DecoderAttention(
            dataclasses.replace(spec, sliding_window=window), {}, backend,
            rotary_emb=rotary_emb, norm=GemmaRMSNorm, scale=gemma.query_pre_attn_scalar**-0.5,
            logits_soft_cap=gemma.attn_soft_cap,
            quant_config=quant_config, prefix=join_prefix(prefix, "self_attn"),
        )  # fmt: skip
        self.mlp = GemmaMLP(spec, quant_config, join_prefix(prefix, "mlp"))
        eps = spec.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = attend(self, positions, hidden, residual, kv_cache, metadata)
        hidden = self.post_attention_layernorm(hidden)
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = self.post_feedforward_layernorm(self.mlp(hidden))
        return hidden, residual


class GemmaModel(DecoderModel):
    """Llama's `DecoderModel` (pipeline stages alike) with Gemma's layers and final norm, and
    the embedding scaled by sqrt(hidden_size)."""

    def __init__(
        self,
        spec: DecoderSpec,
        gemma: GemmaSpec,
        hf_config: dict[str, Any],
        backend: AttentionBackend,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "model",
    ):
        start, end = pp_layer_range(spec.num_layers)
        rotary = {
            kind: RotaryEmbedding(spec.head_dim, spec.max_position, gemma.rope_configs[kind])
            for kind in sorted({gemma.layer_types[i] for i in range(start, end)})
        }

        def make_layer(i: int) -> nn.Module:
            kind = gemma.layer_types[i]
            name = join_prefix(prefix, f"layers.{i}")
            return GemmaDecoderLayer(spec, gemma, kind, rotary[kind], backend, quant_config, name)

        super().__init__(spec, hf_config, backend, make_layer)
        if self.norm is not None:
            self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # sqrt(hidden_size) as a float32 number, rounded to the model dtype where it is used.
        normalizer = torch.tensor(spec.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer("normalizer", normalizer, persistent=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        return hidden * self.normalizer.to(hidden.dtype)


class _GemmaForCausalLM(LlamaForCausalLM):
    """Builds its own decoder; weight loading and pipeline-stage filtering are Llama's (same
    checkpoint names, fused q/k/v and gate/up)."""

    version = 2

    def __init__(self, init: ModelInit):
        nn.Module.__init__(self)  # LlamaForCausalLM.__init__ would build a Llama decoder
        c = init.hf_config
        self.hf_config = c
        spec = DecoderSpec.from_hf(c, qk_norm=self.version == 3)
        # Gemma ties the head to the embedding unless its config says otherwise.
        self.spec = dataclasses.replace(
            spec, tie_word_embeddings=bool(c.get("tie_word_embeddings", True))
        )
        self.gemma = GemmaSpec.from_hf(c, self.version)
        self.model = GemmaModel(self.spec, self.gemma, c, init.attn_backend, init.quant_config)
        self.lm_head = (
            ParallelLMHead(self.spec.vocab_size, self.spec.hidden_size) if is_last_stage() else None
        )
        embed = self.model.embed_tokens
        if self.spec.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.weight = embed.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.gemma.final_soft_cap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma2ForCausalLM(_GemmaForCausalLM):
    version = 2


class Gemma3ForCausalLM(_GemmaForCausalLM):
    """Text-only Gemma 3 (`gemma3_text` configs, e.g. gemma-3-270m and gemma-3-1b)."""

    version = 3
