"""Rejection sampling keeps the target's distribution: greedy rows stop at the first argmax
mismatch, sampled rows emit tokens distributed exactly as the target's (one-hot and model drafts),
every row emits at least one token, and seeded rows repeat."""

from __future__ import annotations

import torch

from inferengine.sample.rejection_sampler import NO_TOKEN, rejection_sample


def one_hot_probs(ids: list[list[int]], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def test_greedy_accepts_until_the_first_mismatch_and_adds_one_token():
    vocab = 6
    # target argmaxes per position: row 0: 1 2 3 (bonus 4); row 1: 5 0 0; row 2: 2 (bonus only)
    target = one_hot_probs([[1, 2, 3, 4], [5, 0, 0, 0], [2, 0, 0, 0]], vocab)
    drafts = torch.tensor([[1, 2, 3], [5, 1, 0], [0, 0, 0]])
    out = rejection_sample(
        drafts, torch.tensor([3, 3, 0]), target, None, torch.tensor([True, True, True])
    )
    assert out.num_accepted.tolist() == [3, 1, 0]
    assert out.token_ids.tolist() == [
        [1, 2, 3, 4],
        [5, 0, NO_TOKEN, NO_TOKEN],
        [2, NO_TOKEN, NO_TOKEN, NO_TOKEN],
    ]


def test_rows_with_fewer_drafts_ignore_the_padding():
    target = one_hot_probs([[3, 1, 1], [3, 1, 1]], 4)
    drafts = torch.tensor([[3, 1], [3, 1]])
    out = rejection_sample(drafts, torch.tensor([1, 2]), target, None, torch.tensor([True, True]))
    assert out.num_accepted.tolist() == [1, 2]
    assert out.token_ids.tolist() == [[3, 1, NO_TOKEN], [3, 1, 1]]


def _distribution(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / tokens.numel()


def _assert_close(observed: torch.Tensor, expected: torch.Tensor, trials: int) -> None:
    # Five standard errors per entry: a real bias of this size is far beyond chance.
    tolerance = 5 * (expected * (1 - expected) / trials).sqrt() + 1e-3
    assert torch.all((observed - expected).abs() <= tolerance), (observed, expected)


def test_one_hot_drafts_keep_the_target_distribution():
    torch.manual_seed(0)
    trials, vocab = 200_000, 5
    p0 = torch.tensor([0.1, 0.4, 0.2, 0.25, 0.05])
    p1 = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    p2 = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2])
    target = torch.stack([p0, p1, p2]).expand(trials, 3, vocab).contiguous()
    drafts = torch.tensor([1, 4]).expand(trials, 2).contiguous()
    out = rejection_sample(
        drafts, torch.full((trials,), 2), target, None, torch.zeros(trials, dtype=torch.bool)
    )
    first = out.token_ids[:, 0]
    _assert_close(_distribution(first, vocab), p0, trials)
    # Given the first draft was accepted, the second token follows p1.
    second = out.token_ids[out.num_accepted >= 1, 1]
    _assert_close(_distribution(second, vocab), p1, second.numel())
    assert abs((out.num_accepted >= 1).float().mean() - p0[1]) < 0.005


def test_model_drafts_keep_the_target_distribution():
    torch.manual_seed(1)
    trials, vocab = 200_000, 4
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    drafts = torch.multinomial(q, trials, replacement=True).unsqueeze(1)
    target = torch.stack([p, p]).expand(trials, 2, vocab).contiguous()
    draft_probs = q.expand(trials, 1, vocab).contiguous()
    out = rejection_sample(
        drafts, torch.ones(trials, dtype=torch.int64), target, draft_probs,
        torch.zeros(trials, dtype=torch.bool),
    )  # fmt: skip
    _assert_close(_distribution(out.token_ids[:, 0], vocab), p, trials)
    # Acceptance rate is sum_x min(p(x), q(x)) = 0.1 + 0.2 + 0.1 + 0.1.
    assert abs((out.num_accepted == 1).float().mean() - 0.5) < 0.005


def test_no_drafts_is_a_plain_draw_from_the_target():
    torch.manual_seed(2)
    trials, vocab = 100_000, 3
    p = torch.tensor([0.6, 0.3, 0.1])
    out = rejection_sample(
        torch.zeros(trials, 0, dtype=torch.int64), torch.zeros(trials, dtype=torch.int64),
        p.expand(trials, 1, vocab).contiguous(), None, torch.zeros(trials, dtype=torch.bool),
    )  # fmt: skip
    assert out.token_ids.shape == (trials, 1) and out.num_accepted.sum() == 0
    _assert_close(_distribution(out.token_ids[:, 0], vocab), p, trials)


def test_seeded_rows_repeat_and_differ_by_seed():
    vocab = 50
    probs = torch.softmax(torch.randn(4, 4, vocab), dim=-1)
    drafts = torch.randint(0, vocab, (4, 3))
    greedy = torch.zeros(4, dtype=torch.bool)

    def run(seeds: list[int]) -> torch.Tensor:
        gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
        return rejection_sample(drafts, torch.full((4,), 3), probs, None, greedy, gens).token_ids

    assert torch.equal(run([1, 2, 3, 4]), run([1, 2, 3, 4]))
    outs = {tuple(run([s] * 4)[0].tolist()) for s in range(20)}
    assert len(outs) > 1


def test_greedy_acceptance_on_the_host_matches_the_rejection_sampler():
    """The all-greedy fast path (argmax rows to the host) emits what rejection sampling with
    greedy rows emits, for random drafts and logits."""
    from inferengine.worker.pending_step import accept_greedy

    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        counts = torch.randint(0, 5, (6,), generator=g).tolist()
        k, vocab = max(counts), 5
        logits = torch.randn(sum(c + 1 for c in counts), vocab, generator=g)
        argmax = logits.argmax(-1).tolist()
        drafts, start = [], 0
        for c in counts:  # drafts that often follow the argmax, sometimes not
            row = [argmax[start + j] if torch.rand(1, generator=g) < 0.7 else 0 for j in range(c)]
            drafts.append(row)
            start += c + 1
        padded = torch.zeros(len(counts), k + 1, vocab)
        start = 0
        for i, c in enumerate(counts):
            padded[i, : c + 1] = logits[start : start + c + 1].softmax(-1)
            start += c + 1
        ids = torch.tensor([row + [0] * (k - len(row)) for row in drafts]).reshape(len(counts), k)
        out = rejection_sample(
            ids, torch.tensor(counts), padded, None, torch.ones(len(counts), dtype=torch.bool)
        )
        expected = [
            row[: n + 1]
            for row, n in zip(out.token_ids.tolist(), out.num_accepted.tolist(), strict=True)
        ]
        assert accept_greedy(argmax, drafts) == expected
