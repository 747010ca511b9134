"""Transformers fallback: an architecture without a native class runs on Transformers' modeling
code, with our paged attention registered as its attention implementation.

The wrapper looks like a native model to the runner: `forward` takes the step's flattened tokens
(all sequences as one batch row, with their positions) and returns hidden states, and
`compute_logits` applies the LM head. Transformers computes everything but attention (its
rotary embedding included); each attention layer's call, found by `module.layer_idx`, goes to
one of our `Attention` layers, which writes K/V into the paged cache and attends over each
sequence's pages. The step (layers, caches, metadata) travels as a keyword argument that
Transformers passes from the model's forward down to the attention function, so nothing of the
batch lives in module state. One device only: no tensor or pipeline parallelism. Whether an
architecture runs here, and the config keys it fills in, are decided before the load
(`checkpoint/architecture.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from inferengine.attention.layer import Attention
from inferengine.attention.metadata import AttentionMetadata
from inferengine.checkpoint.architecture import transformers_config
from inferengine.distributed.parallel_state import get_pp_size, get_tp_size
from inferengine.errors import ModelLoadError
from inferengine.model.llama import ModelInit

ATTN_IMPLEMENTATION = "inferengine_paged"
STEP_KWARG = "inferengine_step"


@dataclass(slots=True)
class PagedStep:
    """What the attention function needs for one forward: our layers, the caches, the batch."""

    layers: nn.ModuleList
    kv_caches: list[torch.Tensor]
    metadata: AttentionMetadata
    attended: set[int] | None = None  # layers that called attention (first step only)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D], rotated
    key: torch.Tensor,  # [1, Hkv, T, D], rotated
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers' attention-function signature; returns ([1, T, Hq, D], no weights)."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, PagedStep):
        raise RuntimeError(
            f"{type(module).__name__} called attention without InferEngine's step: this "
            "model's forward does not pass keyword arguments down to attention."
        )
    layer = step.layers[module.layer_idx]
    if step.attended is not None:
        step.attended.add(module.layer_idx)
    _check_call(module, layer, query, key, scaling, kwargs)
    _, num_heads, num_tokens, head_dim = query.shape

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x[0].transpose(0, 1).reshape(num_tokens, -1)

    out = layer(
        flat(query), flat(key), flat(value), step.kv_caches[module.layer_idx], step.metadata
    )
    return out.view(1, num_tokens, num_heads, head_dim), None


def _check_call(
    module: nn.Module,
    layer: Attention,
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> None:
    """Refuse what our attention does not do; take the call's own scale and window."""
    s = layer.spec
    shape = (query.shape[1], key.shape[1], query.shape[3])
    if query.shape[0] != 1 or shape != (s.num_heads, s.num_kv_heads, s.head_dim):
        raise ModelLoadError(
            f"layer {module.layer_idx} attends with (heads, KV heads, head dim) = {shape}, but "
            f"config.json implies {(s.num_heads, s.num_kv_heads, s.head_dim)}; the Transformers "
            "fallback needs every layer to have the config's shape."
        )
    unsupported = [k for k in ("s_aux", "sinks") if kwargs.get(k) is not None]
    if getattr(module, "is_causal", True) is False:
        unsupported.append("non-causal attention")
    if kwargs.get("softcap") and kwargs["softcap"] != getattr(s, "logits_soft_cap", None):
        unsupported.append("attention logit soft-capping")
    if unsupported:
        raise ModelLoadError(
            f"the Transformers fallback's paged attention does not support {', '.join(unsupported)}"
            f" ({type(module).__name__})."
        )
    window = kwargs.get("sliding_window", s.sliding_window) or None
    scale = s.scale if scaling is None else float(scaling)
    if (scale, window) != (s.scale, s.sliding_window):
        layer.spec = dataclasses.replace(s, scale=scale, sliding_window=window)


def _layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window, as Transformers' masks would apply it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types:
        other = sorted(set(types) - {"full_attention", "sliding_attention"})
        if other:
            raise ModelLoadError(
                f"the Transformers fallback runs full and sliding-window attention layers only; "
                f"this model also has {', '.join(other)} layers."
            )
        return [window if t == "sliding_attention" else None for t in types]
    if getattr(config, "use_sliding_window", True) is False:
        return [None] * n
    return [window] * n


class TransformersForCausalLM(nn.Module):
    """Any causal LM Transformers implements, on the engine's paged KV cache."""

    def __init__(self, init: ModelInit):
        super().__init__()
        if get_tp_size() > 1 or get_pp_size() > 1:
            raise ModelLoadError(
                "the Transformers fallback runs on one device: use --tensor-parallel-size 1 and "
                "--pipeline-parallel-size 1, or a natively supported architecture."
            )
        from transformers import AttentionInterface, AutoModelForCausalLM

        AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
        self.hf_config = init.hf_config
        self.config = transformers_config(init.hf_config)
        c = self.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        cap = getattr(c, "attn_logit_softcapping", None)
        extra = {"logits_soft_cap": cap} if cap else {}
        self.attn = nn.ModuleList(
            Attention(init.attn_backend, heads, kv_heads, head_dim, head_dim**-0.5, w, **extra)
            for w in _layer_windows(c)
        )
        self.checked = False  # every layer seen calling attention (`_check_every_layer_attended`)
        # Built on the meta device: the weights come with `load_weights` (or `materialize`).
        self.device = torch.get_default_device()
        self.dtype = torch.get_default_dtype()
        with torch.device("meta"):
            self.hf = AutoModelForCausalLM.from_config(
                c, dtype=self.dtype, attn_implementation=ATTN_IMPLEMENTATION
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        step = PagedStep(self.attn, kv_caches, metadata, None if self.checked else set())
        out = self.hf.base_model(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            **{STEP_KWARG: step},
        )
        if step.attended is not None:
            self._check_every_layer_attended(step.attended)
        return out[0][0]

    def _check_every_layer_attended(self, attended: set[int]) -> None:
        """A layer that never calls attention keeps some other state (a recurrent or
        state-space layer), which the fallback has no cache for."""
        silent = sorted(set(range(len(self.attn))) - attended)
        if silent:
            raise ModelLoadError(
                f"layers {silent} of {type(self.hf).__name__} do not call attention (recurrent "
                "or state-space layers?); the Transformers fallback keeps only a KV cache."
            )
        self.checked = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head, then the logit scalings Transformers' causal-LM heads apply."""
        logits = self.hf.get_output_embeddings()(hidden)
        c = self.config
        if getattr(c, "logit_scale", None):  # Cohere
            logits = logits * c.logit_scale
        if getattr(c, "logits_scaling", None):  # Granite
            logits = logits / c.logits_scaling
        if getattr(c, "final_logit_softcapping", None):  # Gemma 2/3
            cap = c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Through Transformers' own loader, so its checkpoint renames and conversions apply."""
        hf, info = type(self.hf).from_pretrained(
            None,
            config=self.config,
            state_dict=dict(weights),
            dtype=self.dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
            device_map={"": self.device},
            output_loading_info=True,
        )
        missing = sorted(info.get("missing_keys") or [])
        mismatched = sorted(str(k) for k in info.get("mismatched_keys") or [])
        if missing or mismatched:
            shown = ", ".join((missing + mismatched)[:5])
            raise ModelLoadError(
                f"the checkpoint lacks or misshapes {len(missing) + len(mismatched)} tensors "
                f"Transformers' {type(hf).__name__} needs ({shown}); the download is incomplete "
                "or belongs to another model."
            )
        self.hf = hf.eval()

    def materialize(self) -> None:
        """Real (randomly initialised) weights on the device, for `--load-format dummy`."""
        from transformers import AutoModelForCausalLM

        with torch.device(self.device):
            self.hf = AutoModelForCausalLM.from_config(
                self.config, dtype=self.dtype, attn_implementation=ATTN_IMPLEMENTATION
            ).eval()
