"""The sampler: logits → token ids (and logprobs), row by row settings, no host sync.

Order: logprobs of the raw logits (what vLLM reports), then logit bias, min-tokens bans and
penalties, then greedy argmax or temperature → min-p → top-k/top-p → a draw with per-row
generators (`argmax(p / Exp(1))`, which is a sample from p and needs no sort or sync).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inferengine.sample.metadata import SamplingMetadata, to_device


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # int64 [B]
    # With logprobs: ids [B, 1+N] (sampled first, then the top N), logprobs [B, 1+N], ranks [B].
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_ranks: torch.Tensor | None = None


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output, divide positive / multiply negative logits), then frequency
    and presence (output tokens only), as vLLM and the OpenAI API define them."""
    assert md.repetition_penalty is not None
    assert md.frequency_penalty is not None and md.presence_penalty is not None
    batch, vocab = logits.shape
    device = logits.device
    output_counts = _token_counts(md.output_token_ids, batch, vocab, device)
    seen = output_counts > 0
    seen |= _token_counts(md.prompt_token_ids, batch, vocab, device) > 0
    rep = md.repetition_penalty.unsqueeze(1).expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - md.frequency_penalty.unsqueeze(1) * output_counts
    logits = logits - md.presence_penalty.unsqueeze(1) * (output_counts > 0).float()
    return logits


def _token_counts(
    token_ids: list[list[int]], batch: int, vocab: int, device: torch.device
) -> torch.Tensor:
    counts = torch.zeros(batch, vocab + 1, dtype=torch.float32, device=device)
    lengths = [len(ids) for ids in token_ids]
    if sum(lengths):
        width = max(lengths)
        padded = torch.full((batch, width), vocab, dtype=torch.int64)  # pad -> dropped column
        for row, ids in enumerate(token_ids):
            if ids:
                padded[row, : len(ids)] = torch.tensor(ids)
        padded = padded.clamp_(0, vocab)
        if device.type == "cuda":
            padded = padded.pin_memory().to(device, non_blocking=True)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab]


def apply_bias_and_bans(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Add each row's logit bias and ban its min-tokens stop ids, on a copy of `logits`."""
    logits = logits.clone()  # the caller's logits (often the model's output) stay as they are
    vocab = logits.shape[1]
    device = logits.device
    for row, bias in enumerate(md.logit_bias):
        if bias:
            ids = to_device([i for i in bias if i < vocab], torch.int64, device)
            values = to_device([b for i, b in bias.items() if i < vocab], torch.float32, device)
            logits[row].index_add_(0, ids, values)
    for row, banned in md.banned_token_ids.items():
        ids = to_device([i for i in banned if i < vocab], torch.int64, device)
        logits[row].index_fill_(0, ids, float("-inf"))
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` × the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep the k most likely tokens, then the smallest set whose probability mass reaches p."""
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        kth_smallest_kept = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_smallest_kept, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        # A token stays while the mass of the tokens more likely than it, 1 - (its own and the
        # less likely ones'), is below p. Summing from the least likely side keeps p = 1 exact
        # (`suffix_sum - p` rounds to 1.0 in float32 and dropped tail tokens of p = 1 rows).
        drop = probs.cumsum(dim=-1) <= 1.0 - top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row via argmax(p / E), E ~ Exp(1); seeded rows use their own generator."""
    noise = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        noise.exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return probs.div_(noise).argmax(dim=-1)


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None
        logits = _adjust(logits, md)
        greedy = logits.argmax(dim=-1)
        if md.all_greedy:
            sampled = greedy
        else:
            drawn = random_sample(_draw_probs(logits, md), md.generators)
            assert md.temperature is not None
            sampled = drawn if md.all_random else torch.where(md.temperature > 0, drawn, greedy)
        out = SamplerOutput(sampled=sampled)
        if raw_logprobs is not None:
            assert md.max_num_logprobs is not None
            out.logprob_token_ids, out.logprobs, out.sampled_ranks = gather_logprobs(
                raw_logprobs, sampled, md.max_num_logprobs
            )
        return out

    def target_probs(
        self, logits: torch.Tensor, md: SamplingMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row, the distribution a draw comes from (one-hot at the argmax for greedy rows),
        and which rows are greedy: what the rejection sampler verifies drafts against."""
        logits = _adjust(logits.float(), md)
        one_hot = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if md.all_greedy:
            return one_hot, torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        assert md.temperature is not None
        greedy = md.temperature == 0
        return torch.where(greedy.unsqueeze(1), one_hot, _draw_probs(logits, md)), greedy


def _adjust(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Logit bias, min-tokens bans and penalties: what both greedy and sampled rows see."""
    if md.logit_bias or md.banned_token_ids:
        logits = apply_bias_and_bans(logits, md)
    if md.has_penalties:
        logits = apply_penalties(logits, md)
    return logits


def _draw_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution sampled rows draw from: temperature, min-p, top-k/top-p, softmax."""
    assert md.temperature is not None
    logits = logits / torch.where(md.temperature > 0, md.temperature, 1.0).unsqueeze(1)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    return apply_top_k_top_p(logits, md.top_k, md.top_p).softmax(dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprob and rank of each row's `token_ids`, beside the row's `num_top` best tokens."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
        values = torch.cat([chosen, top_values], dim=1)
    else:
        ids, values = token_ids.unsqueeze(1), chosen
    return ids, values, ranks
