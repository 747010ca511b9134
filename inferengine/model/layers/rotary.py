"""Rotary position embedding (NeoX half-rotation, as Llama/Qwen/Mistral use) and its scalings.

Supported `rope_type`s: default, linear, llama3, yarn, longrope (Phi-3). The cos/sin table is
computed once in float32 for every position up to `max_position`, with the same arithmetic as
Transformers; `partial_rotary_factor` rotates only the first part of each head.

LongRoPE: Transformers picks the short or the long factors per forward call, by the largest
position in it (`seq_len > original_max_position_embeddings` → long). An engine step mixes many
sequences, chunks prompts and reuses cached pages, so a per-call switch would make a token's
keys depend on its neighbours in the batch. We switch per position instead: rows below
`original_max_position_embeddings` use the short factors, rows from it on the long ones (both
times the attention factor). A sequence that stays under the switch point gets exactly
Transformers' rotation; one that grows past it while decoding gets what Transformers' own
cached generation gives (the earlier keys stay short-rotated, new tokens use the long factors).
A prompt longer than the switch point differs from Transformers' one-shot prefill, which
rotates all of its positions with the long factors. vLLM instead picks one set for every
position from `max_model_len` (long when it exceeds the switch point), which changes short
prompts whenever the context is long.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from inferengine.errors import ModelLoadError
from inferengine.model.layers.fused import use_fused_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """`rope_theta` plus the scaling dict, from old (`rope_scaling`) or new (`rope_parameters`)
    style configs."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    params.update(scaling)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if params["rope_type"] == "su":  # LongRoPE's first name (early Phi-3 configs)
        params["rope_type"] = "longrope"
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_scaling type {params['rope_type']!r} is not supported; supported types are "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}. Remove `rope_scaling` from config.json to run "
            "with the model's original context length."
        )
    return params


def _inv_freq(dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    dim: int, base: float, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = params.get("factor") or 1.0
    old_len = params.get("original_max_position_embeddings") or max_position

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def rotary_dim_of(head_dim: int, hf_config: dict[str, Any]) -> int:
    """The rotated dims of each head for models that honour `partial_rotary_factor` (Phi-3;
    Transformers' Llama ignores it), truncated as Transformers does."""
    factor = rope_parameters(hf_config).get("partial_rotary_factor") or 1.0
    return int(head_dim * factor)


def _longrope_cos_sin(
    dim: int, base: float, params: dict[str, Any], hf_config: dict[str, Any], max_position: int
) -> torch.Tensor:
    """[max_position, dim] cos|sin: short factors below the switch point, long ones from it."""
    # Like Transformers: a top-level `original_max_position_embeddings` (Phi-3 keeps it there)
    # wins over the one in the scaling dict.
    original = (
        hf_config.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or max_position
    )
    factor = params.get("factor")
    if factor is None:
        factor = hf_config.get("max_position_embeddings", max_position) / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rows = []
    for ext, first, last in (
        (params["short_factor"], 0, min(original, max_position)),
        (params["long_factor"], original, max_position),
    ):
        if first >= last:
            continue
        ext_factors = torch.tensor(ext, dtype=torch.float32)
        if ext_factors.shape != (dim // 2,):
            raise ModelLoadError(
                f"rope_scaling longrope factors must have {dim // 2} entries (half the rotary "
                f"dim {dim}); got {ext_factors.shape[0]}. Check config.json."
            )
        inv_freq = 1.0 / (ext_factors * base**exponents)
        freqs = torch.outer(torch.arange(first, last, dtype=torch.float32), inv_freq)
        rows.append(torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor)
    return torch.cat(rows)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        hf_config: dict[str, Any],
        rotary_dim: int | None = None,
    ):
        super().__init__()
        params = rope_parameters(hf_config)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        base = float(params["rope_theta"])
        scale = 1.0
        kind = params["rope_type"]
        if kind == "longrope":
            cache = _longrope_cos_sin(self.rotary_dim, base, params, hf_config, max_position)
            self.register_buffer("cos_sin_cache", cache, persistent=False)
            return
        inv_freq = _inv_freq(self.rotary_dim, base)
        if kind == "linear":
            inv_freq = inv_freq / params["factor"]
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif kind == "yarn":
            inv_freq, scale = _yarn_inv_freq(self.rotary_dim, base, params, max_position)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # [max_position, rotary_dim]: cos for the first half, sin for the second.
        cache = torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def fusable_into_kv_store(self, query: torch.Tensor) -> bool:
        """Whether a backend may apply this rotation in its fused rotary + KV-store kernel."""
        if not use_fused_kernels(query):
            return False
        from inferengine.kernels.kv_store import rotary_store_kv_supported

        return rotary_store_kv_supported(self.head_dim, self.rotary_dim)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        per_step: dict[Any, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, Hq·D], key [T, Hkv·D] → rotated (in place on CUDA, copies on the CPU).
        `per_step`: a dict that lives for one step (`AttentionMetadata.per_step`), where the
        CPU path keeps the step's cos/sin rows for every layer that shares this table."""
        if use_fused_kernels(query):
            from inferengine.kernels.rotary import rotary_embedding

            return rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_dim)
        if self.rotary_dim == self.head_dim:
            return self._rotate_whole_heads(positions, query, key, per_step)
        cos_sin = self.cos_sin_cache[positions]
        cos, sin = cos_sin.chunk(2, dim=-1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate_whole_heads(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        per_step: dict[Any, Any] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`_rotate`'s products and sums in fewer ops (each costs microseconds on a CPU): the
        tables are built once for query and key (and, given `per_step`, once for every layer
        of the step), and rotate-half is a roll of each head with the sign folded into sin:
        x·cos + roll(x)·(−sin | sin) = x·cos + (−x2 | x1)·sin."""
        step_key = ("rotary", id(self.cos_sin_cache), query.dtype)
        kept = None if per_step is None else per_step.get(step_key)
        if kept is not None and kept[0] is positions:  # the same positions tensor
            cos, sin = kept[1], kept[2]
        else:
            cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
            cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(query.dtype)
            sin = torch.cat([-sin, sin], dim=-1).unsqueeze(1).to(query.dtype)
            if per_step is not None:
                per_step[step_key] = (positions, cos, sin)
        half = self.head_dim // 2

        def rotate(x: torch.Tensor) -> torch.Tensor:
            heads = x.view(x.shape[0], -1, self.head_dim)
            return (heads * cos + heads.roll(half, dims=-1) * sin).view(x.shape)

        return rotate(query), rotate(key)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        cos = torch.cat([cos, cos], dim=-1).unsqueeze(1).to(x.dtype)
        sin = torch.cat([sin, sin], dim=-1).unsqueeze(1).to(x.dtype)
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
        return torch.cat([rotated, rest], dim=-1).reshape(shape)
