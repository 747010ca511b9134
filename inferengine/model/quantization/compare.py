"""How far a quantized model's next-token distributions are from the unquantized model's:
argmax agreement and KL divergence per position (tests and `benchmarks/fp8_accuracy.py`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LogitAgreement:
    positions: int
    argmax_agreement: float  # fraction of positions whose most likely token is the same
    mean_kl: float  # KL(reference ‖ candidate) in nats, mean over positions
    p99_kl: float
    max_kl: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def compare_logits(reference: torch.Tensor, candidate: torch.Tensor) -> LogitAgreement:
    """Logits (or log-probabilities) [..., vocab] of the same positions from two models."""
    kl, agree, _ = position_stats(reference, candidate)
    return summarize(kl, agree)


def position_stats(
    reference: torch.Tensor, candidate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position: KL(reference ‖ candidate) in nats, whether the argmaxes agree (1.0 or
    0.0), and the reference's top-two log-probability margin (how near a tie its choice was);
    float32 on the inputs' device. Gather these over batches and `summarize` them once."""
    if reference.shape != candidate.shape:
        raise ValueError(f"shapes differ: {tuple(reference.shape)} vs {tuple(candidate.shape)}")
    vocab = reference.shape[-1]
    ref = torch.log_softmax(reference.reshape(-1, vocab).float(), dim=-1)
    cand = torch.log_softmax(candidate.reshape(-1, vocab).float(), dim=-1)
    # 0 · log 0 counts as 0 where the reference gives a token no probability.
    kl = torch.where(ref.isneginf(), 0.0, ref.exp() * (ref - cand)).sum(dim=-1)
    top2 = ref.topk(min(2, vocab), dim=-1).values
    margin = top2[:, 0] - top2[:, -1]
    return kl, (ref.argmax(dim=-1) == cand.argmax(dim=-1)).float(), margin


def summarize(kl: torch.Tensor, agree: torch.Tensor) -> LogitAgreement:
    n = kl.numel()
    if n == 0:
        return LogitAgreement(0, 1.0, 0.0, 0.0, 0.0)
    kl = kl.float().cpu()
    return LogitAgreement(
        positions=n,
        argmax_agreement=float(agree.float().mean()),
        mean_kl=float(kl.mean()),
        p99_kl=float(kl.quantile(0.99)),
        max_kl=float(kl.max()),
    )


def agreement_by_margin(
    agree: torch.Tensor, margin: torch.Tensor, thresholds: Sequence[float]
) -> list[dict[str, float]]:
    """Argmax agreement over the positions whose reference top-two margin is at least each
    threshold (nats): where random weights leave most choices near ties, agreement on the
    decisive positions is what quantization can be held to."""
    rows = []
    for threshold in thresholds:
        chosen = margin >= threshold
        n = int(chosen.sum())
        rate = float(agree[chosen].float().mean()) if n else 1.0
        rows.append({"min_margin": threshold, "positions": n, "argmax_agreement": rate})
    return rows


def dense_logprobs(positions: Sequence[Mapping[int, Any]], vocab_size: int) -> torch.Tensor:
    """Per-position {token id: Logprob} maps (an engine's logprobs output) as a dense
    [positions, vocab] tensor; tokens a map lacks get -inf (ask for the whole vocabulary)."""
    out = torch.full((len(positions), vocab_size), float("-inf"))
    for row, position in enumerate(positions):
        for token, logprob in position.items():
            out[row, token] = logprob.logprob
    return out


def token_agreement(
    reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]
) -> float:
    """Fraction of generated positions where two runs chose the same token (position by
    position: after a first difference the two continue from different text)."""
    same = total = 0
    for a, b in zip(reference, candidate, strict=True):
        total += max(len(a), len(b))
        same += sum(x == y for x, y in zip(a, b, strict=False))
    return same / total if total else 1.0
