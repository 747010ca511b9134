"""`SamplingMetadata`: the per-row sampling settings of one batch, as tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from inferengine.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor | None  # float32 [B]; rows with 0 are greedy. None: all greedy
    top_k: torch.Tensor | None  # int64 [B]; 0 = off. None when no row uses it
    top_p: torch.Tensor | None  # float32 [B]; 1 = off
    min_p: torch.Tensor | None  # float32 [B]; 0 = off
    all_greedy: bool
    all_random: bool
    generators: dict[int, torch.Generator]  # row -> its seeded generator
    # Penalties; None when no row has any.
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_token_ids: list[list[int]] = field(default_factory=list)
    prompt_token_ids: list[list[int]] = field(default_factory=list)
    logit_bias: list[dict[int, float] | None] = field(default_factory=list)
    # row -> token ids that may not be sampled yet (min_tokens not reached).
    banned_token_ids: dict[int, list[int]] = field(default_factory=dict)
    max_num_logprobs: int | None = None  # None: no row wants logprobs

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty is not None


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small tensor on `device` without a host sync (pinned memory, asynchronous copy)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def build_sampling_metadata(
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    output_token_ids: list[list[int]],
    prompt_token_ids: list[list[int]],
    eos_token_ids: list[int | None],
    device: torch.device,
) -> SamplingMetadata:
    """Gather one batch's sampling settings (rows in batch order)."""
    temperature = [0.0 if p.greedy else p.temperature for p in params]
    all_greedy = all(t == 0.0 for t in temperature)
    all_random = all(t != 0.0 for t in temperature)

    def column(values: list, dtype: torch.dtype, neutral) -> torch.Tensor | None:
        if all(v == neutral for v in values):
            return None
        return to_device(values, dtype, device)

    any_penalty = any(p.uses_penalties for p in params)
    banned: dict[int, list[int]] = {}
    for row, p in enumerate(params):
        if p.min_tokens and len(output_token_ids[row]) < p.min_tokens:
            ids = set(p.all_stop_token_ids)
            if eos_token_ids[row] is not None and not p.ignore_eos:
                ids.add(eos_token_ids[row])
            banned[row] = sorted(ids)
    wants_logprobs = [p.logprobs for p in params if p.logprobs is not None]
    return SamplingMetadata(
        temperature=None if all_greedy else to_device(temperature, torch.float32, device),
        top_k=None if all_greedy else column([p.top_k for p in params], torch.int64, 0),
        top_p=None if all_greedy else column([p.top_p for p in params], torch.float32, 1.0),
        min_p=None if all_greedy else column([p.min_p for p in params], torch.float32, 0.0),
        all_greedy=all_greedy,
        all_random=all_random,
        generators={row: g for row, g in enumerate(generators) if g is not None},
        presence_penalty=to_device([p.presence_penalty for p in params], torch.float32, device)
        if any_penalty
        else None,
        frequency_penalty=to_device([p.frequency_penalty for p in params], torch.float32, device)
        if any_penalty
        else None,
        repetition_penalty=to_device([p.repetition_penalty for p in params], torch.float32, device)
        if any_penalty
        else None,
        output_token_ids=output_token_ids if any_penalty else [],
        prompt_token_ids=prompt_token_ids if any_penalty else [],
        logit_bias=[p.logit_bias for p in params] if any(p.logit_bias for p in params) else [],
        banned_token_ids=banned,
        max_num_logprobs=max(wants_logprobs) if wants_logprobs else None,
    )
