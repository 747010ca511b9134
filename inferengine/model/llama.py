"""Llama-style decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2, Qwen3, Phi-3): one class, flags per family.

The forward is engine-shaped: flattened tokens of many sequences, their positions, paged KV
caches and an `AttentionMetadata`; it returns hidden states, and `compute_logits` turns the rows
the caller picks into logits.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from inferengine.attention.backends.base import AttentionBackend
from inferengine.attention.layer import Attention
from inferengine.attention.metadata import AttentionMetadata
from inferengine.distributed.parallel_state import (
    get_tp_size,
    is_first_stage,
    is_last_stage,
    pp_layer_range,
)
from inferengine.model.kv_scales import KVScales
from inferengine.model.layers.activation import SiluAndMul
from inferengine.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from inferengine.model.layers.norm import RMSNorm
from inferengine.model.layers.rotary import RotaryEmbedding, rope_parameters, rotary_dim_of
from inferengine.model.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from inferengine.model.quantization.base import join_prefix
from inferengine.model.weights import load_named_weights, split_fused_rows

if TYPE_CHECKING:
    from inferengine.model.quantization.base import QuantizationConfig


@dataclass(frozen=True)
class ModelInit:
    """What every model class is built from (the argument of `register_model` classes).
    `quant_config`: the weights' format, which the model hands to its linear layers with each
    one's name (`prefix`); None: unquantized."""

    hf_config: dict[str, Any]
    attn_backend: AttentionBackend
    quant_config: QuantizationConfig | None = None


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    rotary_dim: int | None = None  # None: the whole head

    @classmethod
    def from_hf(
        cls,
        c: dict[str, Any],
        *,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        partial_rotary: bool = False,
    ):
        num_heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // num_heads
        attention_bias = bool(c.get("attention_bias", False))
        use_sliding = c.get("use_sliding_window", True)  # Qwen2 keeps a flag beside the size
        return cls(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            intermediate_size=c["intermediate_size"],
            num_layers=c["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=c.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            max_position=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(c.get("mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=c.get("sliding_window") if use_sliding else None,
            rotary_dim=rotary_dim_of(head_dim, c) if partial_rotary else None,
        )


def add_projections(
    attn: nn.Module,
    spec: DecoderSpec,
    quant_config: QuantizationConfig | None = None,
    prefix: str = "",
) -> None:
    """An attention module's head counts on this rank and its qkv and output projections
    (`prefix`: the attention module's name)."""
    tp = get_tp_size()
    attn.num_heads = spec.num_heads // tp
    attn.num_kv_heads = max(1, spec.num_kv_heads // tp)
    attn.head_dim = spec.head_dim
    attn.q_size = attn.num_heads * spec.head_dim
    attn.kv_size = attn.num_kv_heads * spec.head_dim
    attn.qkv_proj = QKVParallelLinear(
        spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.qkv_bias,
        quant_config, join_prefix(prefix, "qkv_proj"),
    )  # fmt: skip
    attn.o_proj = RowParallelLinear(
        spec.num_heads * spec.head_dim, spec.hidden_size, spec.o_bias,
        quant_config, join_prefix(prefix, "o_proj"),
    )  # fmt: skip


class DecoderAttention(nn.Module):
    """Self-attention of a decoder layer. A family that differs (Gemma) passes its rotary table
    (shared between layers), q/k norm class, scale and logit soft-cap."""

    def __init__(
        self,
        spec: DecoderSpec,
        hf_config: dict[str, Any],
        backend: AttentionBackend,
        *,
        rotary_emb: RotaryEmbedding | None = None,
        norm: type[nn.Module] = RMSNorm,
        scale: float | None = None,
        logits_soft_cap: float | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        add_projections(self, spec, quant_config, prefix)
        if rotary_emb is None:
            rotary_emb = RotaryEmbedding(
                spec.head_dim, spec.max_position, hf_config, spec.rotary_dim
            )
        self.rotary_emb = rotary_emb
        self.q_norm = norm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = norm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.attn = Attention(
            backend,
            self.num_heads,
            self.num_kv_heads,
            spec.head_dim,
            spec.head_dim**-0.5 if scale is None else scale,
            spec.sliding_window,
            logits_soft_cap,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            n = q.shape[0]
            q = self.q_norm(q.reshape(n, -1, self.head_dim)).view(n, self.q_size)
            k = self.k_norm(k.reshape(n, -1, self.head_dim)).view(n, self.kv_size)
        out = self.attn(q, k, v, kv_cache, metadata, positions, self.rotary_emb)
        return self.o_proj(out)


class DecoderMLP(nn.Module):
    def __init__(
        self, spec: DecoderSpec, quant_config: QuantizationConfig | None = None, prefix: str = ""
    ):
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, [size, size], spec.mlp_bias,
            quant_config, join_prefix(prefix, "gate_up_proj"),
        )  # fmt: skip
        self.down_proj = RowParallelLinear(
            size, spec.hidden_size, spec.mlp_bias, quant_config, join_prefix(prefix, "down_proj")
        )
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        hf_config: dict[str, Any],
        backend: AttentionBackend,
        mlp: nn.Module | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ):
        super().__init__()
        self.self_attn = DecoderAttention(
            spec, hf_config, backend,
            quant_config=quant_config, prefix=join_prefix(prefix, "self_attn"),
        )  # fmt: skip
        if mlp is None:
            mlp = DecoderMLP(spec, quant_config, join_prefix(prefix, "mlp"))
        self.mlp = mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = attend(self, positions, hidden, residual, kv_cache, metadata)
        norm = self.post_attention_layernorm
        if self._mlp_reads_norm_directly():
            norm = functools.partial(norm, fp8_consumer=self.mlp.gate_up_proj)
        hidden, residual = norm(hidden, residual)
        return self.feed_forward(hidden, metadata), residual

    def _mlp_reads_norm_directly(self) -> bool:
        """Whether gate_up_proj alone reads the post-attention norm's output (a dense MLP
        called as is), so the norm may hand that output over in FP8."""
        return (
            isinstance(self.post_attention_layernorm, RMSNorm)
            and type(self.mlp) is DecoderMLP
            and type(self).feed_forward is DecoderLayer.feed_forward
        )

    def feed_forward(self, hidden: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        return self.mlp(hidden)


def attend(
    layer: nn.Module,
    positions: torch.Tensor,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's first half: its input norm (with the residual add carried from the layer
    before) and self-attention; (attention output, residual)."""
    norm = layer.input_layernorm
    if isinstance(norm, RMSNorm) and type(layer.self_attn) is DecoderAttention:
        # Its output goes straight to qkv_proj, which may take it in FP8.
        norm = functools.partial(norm, fp8_consumer=layer.self_attn.qkv_proj)
    if residual is None:
        residual = hidden
        hidden = norm(hidden)
    else:
        hidden, residual = norm(hidden, residual)
    return layer.self_attn(positions, hidden, kv_cache, metadata), residual


class MissingLayer(nn.Module):
    """A place holder for a layer another pipeline stage runs (keeps layer indices aligned)."""


class DecoderModel(nn.Module):
    """With pipeline parallelism a stage builds only its layers; the first stage embeds, the
    last one normalises, and the others take and return `(hidden, residual)`. `make_layer(i)`
    builds layer i (a `DecoderLayer` by default, named `{prefix}.layers.{i}`)."""

    def __init__(
        self,
        spec: DecoderSpec,
        hf_config: dict[str, Any],
        backend: AttentionBackend,
        make_layer: Callable[[int], nn.Module] | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "model",
    ):
        super().__init__()
        self.start_layer, self.end_layer = pp_layer_range(spec.num_layers)
        self.embed_tokens = (
            VocabParallelEmbedding(spec.vocab_size, spec.hidden_size) if is_first_stage() else None
        )
        if make_layer is None:

            def make_layer(i: int) -> nn.Module:
                name = join_prefix(prefix, f"layers.{i}")
                return DecoderLayer(spec, hf_config, backend, None, quant_config, name)

        self.layers = nn.ModuleList(
            make_layer(i) if self.start_layer <= i < self.end_layer else MissingLayer()
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if is_last_stage() else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.embed_tokens is not None:
            hidden, residual = self.embed(input_ids), None
        else:
            assert intermediate is not None, "a later pipeline stage needs the previous' output"
            hidden, residual = intermediate
        local = self.layers[self.start_layer : self.end_layer]
        for layer, kv_cache in zip(local, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
        if self.norm is None:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Also Mistral; Qwen2 and Qwen3 set their flags in subclasses."""

    qkv_bias = False
    qk_norm = False
    partial_rotary = False  # honour `partial_rotary_factor` (Transformers' Llama ignores it)
    # HF checkpoint name -> (our parameter name, shard id)
    stacked_params = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )

    def __init__(self, init: ModelInit):
        super().__init__()
        self.hf_config = init.hf_config
        self.spec = DecoderSpec.from_hf(
            init.hf_config,
            qkv_bias=self.qkv_bias,
            qk_norm=self.qk_norm,
            partial_rotary=self.partial_rotary,
        )
        self.model = DecoderModel(
            self.spec, init.hf_config, init.attn_backend, lambda i: self.decoder_layer(i, init)
        )
        self.lm_head = (
            ParallelLMHead(self.spec.vocab_size, self.spec.hidden_size) if is_last_stage() else None
        )
        embed = self.model.embed_tokens
        if self.spec.tie_word_embeddings and self.lm_head is not None and embed is not None:
            self.lm_head.weight = embed.weight

    def decoder_layer(self, index: int, init: ModelInit) -> nn.Module:
        """Layer `index` (mixture-of-experts models give some layers another MLP)."""
        return DecoderLayer(
            self.spec, init.hf_config, init.attn_backend,
            quant_config=init.quant_config, prefix=f"model.layers.{index}",
        )  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.model(input_ids, positions, kv_caches, metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        assert self.lm_head is not None, "only the last pipeline stage computes logits"
        return self.lm_head.compute_logits(hidden)

    def wants_weight(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to this pipeline stage."""
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            return self.model.start_layer <= index < self.model.end_layer
        if name.startswith("model.embed_tokens."):
            # A tied LM head on a later stage loads from the embedding.
            tied_head = self.spec.tie_word_embeddings and self.lm_head is not None
            return self.model.embed_tokens is not None or tied_head
        if name.startswith("model.norm."):
            return self.model.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        skip = ("rotary_emb.inv_freq",)
        if self.spec.tie_word_embeddings:
            skip += ("lm_head.weight",)
        if self.spec.tie_word_embeddings and self.model.embed_tokens is None:
            weights = (
                ("lm_head.weight" if n == "model.embed_tokens.weight" else n, t) for n, t in weights
            )
            skip = ("rotary_emb.inv_freq",)
        kv_scales = KVScales()
        load_named_weights(
            self,
            kv_scales.take(w for w in weights if self.wants_weight(w[0])),
            self.stacked_params,
            skip,
            route=self.route_weight,
        )
        kv_scales.apply(self)

    def route_weight(self, name: str) -> tuple[str, Any] | None:
        """This model's own (parameter name, shard id) for checkpoint tensor `name`, tried
        before `stacked_params`; None for the default placement."""
        return None


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5 and Phi-4 (dense): Llama's layers, with q/k/v and gate/up fused in the
    checkpoint (split into our shards on load, so each rank reads its rows), LongRoPE and
    `partial_rotary_factor`."""

    partial_rotary = True

    def __init__(self, init: ModelInit):
        super().__init__(replace(init, hf_config=_phi3_config(init.hf_config)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        s = self.spec
        q, kv, mlp = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        fused = {
            "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
            "gate_up_proj": [("gate_proj", mlp), ("up_proj", mlp)],
        }
        super().load_weights(split_fused_rows(weights, fused))


def _phi3_config(c: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's config defaults and old names, as Transformers' `Phi3Config` reads them."""
    c = dict(c)
    c.setdefault("rms_norm_eps", 1e-5)
    for key in ("rope_scaling", "rope_parameters"):
        scaling = c.get(key)
        if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in (
            "su",
            "yarn",
        ):
            scaling = {k: v for k, v in scaling.items() if k != "type"}
            c[key] = {**scaling, "rope_type": "longrope"}
    if rope_parameters(c)["rope_type"] == "longrope":
        c.setdefault("original_max_position_embeddings", 4096)
    return c
