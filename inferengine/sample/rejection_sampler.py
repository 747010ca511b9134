"""Speculative verification: accept draft tokens so that the output keeps the target's distribution.

For each request, draft tokens d_1..d_k (from a proposer with distribution q, or one-hot for
n-gram drafts) are checked against the target's probabilities p at the same positions:

- greedy rows accept d_j while it is the target's argmax, then emit the argmax where they stop;
- sampled rows accept d_j with probability min(1, p(d_j) / q(d_j)); at the first rejection they
  emit a draw from the residual max(p - q, 0) (for one-hot q: p without d_j), and when every draft
  passes, a bonus draw from the target's next position.

That is the standard scheme (Leviathan et al. 2023, Chen et al. 2023): each emitted token is
distributed exactly as sampling from the target alone. Every step emits at least one token.
Seeded rows draw from their own generator, uniforms first, then the one residual or bonus draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferengine.sample.sampler import random_sample

NO_TOKEN = -1


@dataclass
class RejectionOutput:
    token_ids: torch.Tensor  # int64 [B, K + 1]: the accepted drafts, then one more; NO_TOKEN after
    num_accepted: torch.Tensor  # int64 [B]: drafts accepted; each row emits num_accepted + 1


def rejection_sample(
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    generators: dict[int, torch.Generator] | None = None,
) -> RejectionOutput:
    """Verify a padded batch of drafts.

    draft_token_ids: int64 [B, K], entries past a row's `num_draft` are ignored.
    num_draft: int64 [B], 0..K.
    target_probs: float [B, K + 1, V]; row j verifies draft j, row num_draft[b] is the bonus
        position (the target's probabilities after temperature, top-k/top-p and penalties).
    draft_probs: float [B, K, V] for a draft model, None for one-hot (n-gram) drafts.
    greedy: bool [B]; these rows compare argmaxes and use no randomness.
    """
    generators = generators or {}
    batch, k = draft_token_ids.shape
    if target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(f"target_probs must be [B, K + 1, V], got {tuple(target_probs.shape)}")
    device = target_probs.device
    positions = torch.arange(k, device=device)
    valid = positions.unsqueeze(0) < num_draft.unsqueeze(1)
    drafts = torch.where(valid, draft_token_ids, 0)

    verify = target_probs[:, :k]
    p_draft = verify.gather(2, drafts.unsqueeze(2)).squeeze(2)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2)
    uniform = _uniform(batch, k, generators, device)
    accept_sampled = uniform * q_draft < p_draft
    accept_greedy = verify.argmax(dim=2) == drafts
    accept = torch.where(greedy.unsqueeze(1), accept_greedy, accept_sampled) & valid
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=device)
    stop_probs = target_probs[rows, num_accepted]  # [B, V]: where each row stops
    rejected = num_accepted < num_draft
    residual = stop_probs
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_stop = torch.zeros_like(stop_probs)
            q_stop[rows, drafts[rows, at]] = 1.0
        else:
            q_stop = draft_probs[rows, at]
        leftover = (stop_probs - q_stop).clamp(min=0.0)
        # p == q leaves nothing, but then no draft can be rejected; keep p for safety.
        usable = rejected & (leftover.sum(dim=1) > 0)
        residual = torch.where(usable.unsqueeze(1), leftover, stop_probs)
    drawn = random_sample(residual / residual.sum(dim=1, keepdim=True), generators)
    last = torch.where(greedy, stop_probs.argmax(dim=1), drawn)

    token_ids = torch.full((batch, k + 1), NO_TOKEN, dtype=torch.int64, device=device)
    keep = positions.unsqueeze(0) < num_accepted.unsqueeze(1)
    token_ids[:, :k] = torch.where(keep, drafts, NO_TOKEN)
    token_ids[rows, num_accepted] = last
    return RejectionOutput(token_ids=token_ids, num_accepted=num_accepted)


def _uniform(
    batch: int, k: int, generators: dict[int, torch.Generator], device: torch.device
) -> torch.Tensor:
    uniform = torch.rand(batch, k, device=device)
    for row, generator in generators.items():
        uniform[row] = torch.rand(k, device=device, generator=generator)
    return uniform
