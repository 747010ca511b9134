"""Sampler: seeded draws, top-k/top-p/min-p support, penalties, bias, bans, greedy rows, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from inferengine.sample.metadata import SamplingMetadata, build_sampling_metadata
from inferengine.sample.sampler import (
    Sampler,
    apply_bias_and_bans,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    gather_logprobs,
)
from inferengine.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 1


def metadata(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    seeded: bool = True,
) -> SamplingMetadata:
    """Metadata as the model runner builds it: a fresh generator for every seeded random row."""
    generators = [
        torch.Generator().manual_seed(p.seed)
        if seeded and p.seed is not None and not p.greedy
        else None
        for p in params
    ]
    return build_sampling_metadata(
        params,
        generators,
        outputs or [[] for _ in params],
        prompts or [[] for _ in params],
        [EOS] * len(params),
        CPU,
    )


def distinct_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    """Random logits whose values (and gaps between them) are all distinct."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen, dtype=torch.float32) * scale


# ---- seeded reproducibility -----------------------------------------------------------------


def draw_sequence(
    target: SamplingParams, others: list[SamplingParams], position: int, steps: int
) -> list[int]:
    """Tokens of `target` over `steps` draws, sitting at `position` among `others`."""
    params = [*others[:position], target, *others[position:]]
    md = metadata(params)
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        logits = distinct_logits(len(params), 64, seed=100 + step)
        # The target's row always sees the same logits, whatever the batch.
        logits[position] = distinct_logits(1, 64, seed=step)[0]
        tokens.append(int(sampler(logits, md).sampled[position]))
    return tokens


def test_seeded_draws_do_not_depend_on_the_batch():
    target = SamplingParams(temperature=1.3, top_p=0.95, top_k=40, seed=1234)
    alone = draw_sequence(target, [], 0, steps=30)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, min_p=0.05),
        SamplingParams(temperature=1.0, seed=99, top_p=0.5),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, logit_bias={3: 4.0}),
    ]
    torch.manual_seed(1)
    assert draw_sequence(target, others, 2, steps=30) == alone
    torch.manual_seed(2)
    assert draw_sequence(target, others[::-1], 4, steps=30) == alone
    assert draw_sequence(target, others[:1], 1, steps=30) == alone
    other_seed = SamplingParams(temperature=1.3, top_p=0.95, top_k=40, seed=1235)
    assert draw_sequence(other_seed, [], 0, steps=30) != alone
    assert len(set(alone)) > 5  # really random, not stuck on one token


# ---- top-k / top-p / min-p support ----------------------------------------------------------


def expected_support(
    logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float
):
    """The tokens that may be drawn, computed in float64; None when a threshold is too close."""
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    keep = probs >= min_p * probs.max()
    if min_p and np.min(np.abs(probs / probs.max() - min_p)) < 1e-4:
        return None
    order = np.argsort(-scaled)
    if top_k:
        keep[order[top_k:]] = False
    kept_order = [i for i in order if keep[i]]
    mass = probs[kept_order] / probs[kept_order].sum()
    above = np.concatenate([[0.0], np.cumsum(mass)[:-1]])  # mass of more likely kept tokens
    if top_p < 1 and len(above) > 1 and np.min(np.abs(above[1:] - top_p)) < 1e-4:
        return None
    return {int(i) for i, a in zip(kept_order, above, strict=True) if a < top_p}


CASES = [
    # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (1.0, 5, 1.0, 0.0),
    (0.7, 0, 0.6, 0.0),
    (1.5, 0, 1.0, 0.1),
    (1.0, 10, 0.8, 0.0),
    (0.5, 12, 0.9, 0.02),
    (2.0, 0, 0.3, 0.3),
    (1.0, 1, 1.0, 0.0),
    (1.0, 100, 1.0, 0.0),  # k above the vocabulary: everything
    (1.0, 0, 1e-6, 0.0),  # only the best token
]


def masked_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits the sampler draws from, through the same functions in the same order."""
    logits = logits / md.temperature.unsqueeze(1)
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    return apply_top_k_top_p(logits, md.top_k, md.top_p)


@pytest.mark.parametrize("seed", range(5))
def test_top_k_top_p_min_p_keep_exactly_the_expected_support(seed):
    vocab = 48
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for t, k, p, m in CASES]
    expected = []
    rng_seed = 1000 * seed
    logits = torch.empty(len(CASES), vocab)
    for row, (t, k, p, m) in enumerate(CASES):
        for _ in range(20):  # redraw the rare logits that sit on a threshold in float32
            candidate = distinct_logits(1, vocab, rng_seed)[0]
            rng_seed += 1
            support = expected_support(candidate.numpy(), t, k, p, m)
            if support is not None:
                break
        assert support is not None
        logits[row] = candidate
        expected.append(support)
    kept = masked_logits(logits, metadata(params))
    for row in range(len(CASES)):
        got = set(torch.nonzero(~torch.isinf(kept[row])).flatten().tolist())
        assert got == expected[row], CASES[row]
    assert len(expected[-1]) == 1 and len(expected[-2]) == vocab


def test_draws_never_leave_the_support():
    vocab, draws = 32, 4000
    base = distinct_logits(1, vocab, seed=7)[0]
    for t, k, p, m in [(1.0, 4, 1.0, 0.0), (0.8, 0, 0.7, 0.0), (1.2, 0, 1.0, 0.15)]:
        support = expected_support(base.numpy(), t, k, p, m)
        assert support is not None
        params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)] * draws
        torch.manual_seed(3)
        sampled = Sampler()(base.expand(draws, vocab).clone(), metadata(params)).sampled
        seen = set(sampled.tolist())
        assert seen <= support
        assert len(seen) >= min(len(support), 3)
    # With k = 4 every kept token shows up in 4000 draws.
    params = [SamplingParams(top_k=4)] * draws
    sampled = Sampler()(base.expand(draws, vocab).clone(), metadata(params)).sampled
    assert set(sampled.tolist()) == expected_support(base.numpy(), 1.0, 4, 1.0, 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_top_p_of_one_keeps_every_token_beside_rows_that_use_top_p(seed):
    logits = distinct_logits(2, 5000, seed=seed, scale=4.0)
    kept = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.5]))
    assert not torch.isinf(kept[0]).any()
    assert torch.isinf(kept[1]).any()


def test_top_k_and_top_p_keep_the_most_likely_token():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 2.0 - 1e-3, -9.0]])
    kept = apply_top_k_top_p(logits, torch.tensor([1, 1]), torch.tensor([1e-9, 1e-9]))
    assert torch.isinf(kept).tolist() == [[True, False, True], [False, True, True]]


# ---- penalties, bias, bans ------------------------------------------------------------------


def test_penalties_match_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0], [2.0, -1.0, 0.5, -3.0, 1.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    md = metadata(params, outputs=[[2, 2, 3], [2, 2, 3]], prompts=[[0, 1], [0, 1]])
    out = apply_penalties(logits.clone(), md)
    # Repetition (prompt or output): 2/2, -1*2, 0.5/2, -3*2; token 4 unseen.
    # Frequency (output counts 2 and 1) and presence (output only) on tokens 2 and 3.
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 * 2 - 0.25, -3.0 * 2 - 0.5 * 1 - 0.25, 1.0]
    torch.testing.assert_close(out[0], torch.tensor(expected))
    torch.testing.assert_close(out[1], logits[1])  # neutral row untouched


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # Below 1 the repetition penalty favours seen tokens: 3/0.5, -3*0.5, 0.5/0.5.
        (SamplingParams(repetition_penalty=0.5), [6.0, -1.5, 1.0, -2.0]),
        (SamplingParams(frequency_penalty=1.5), [3.0, -3.0 - 3.0, 0.5 - 1.5, -2.0]),
        (SamplingParams(frequency_penalty=-1.0), [3.0, -3.0 + 2.0, 0.5 + 1.0, -2.0]),
        (SamplingParams(presence_penalty=2.0), [3.0, -5.0, -1.5, -2.0]),
    ],
)
def test_each_penalty_alone(params, expected):
    logits = torch.tensor([[3.0, -3.0, 0.5, -2.0]])
    # Token 0 is in the prompt, token 1 twice in the output, token 2 once.
    md = metadata([params], outputs=[[1, 2, 1]], prompts=[[0, 0]])
    torch.testing.assert_close(apply_penalties(logits, md)[0], torch.tensor(expected))


def test_repetition_penalty_changes_the_greedy_token():
    logits = torch.tensor([[4.0, 3.0, 0.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    assert Sampler()(logits, metadata(params, outputs=[[0]], prompts=[[2]])).sampled.item() == 1


def test_logit_bias_adds_and_skips_ids_outside_the_vocabulary():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    params = [
        SamplingParams(temperature=0.0, logit_bias={0: 5.0, 3: -2.5, 10: 100.0}),
        SamplingParams(temperature=0.0, logit_bias={7: 50.0}),
    ]
    md = metadata(params)
    out = apply_bias_and_bans(logits.clone(), md)
    torch.testing.assert_close(out, torch.tensor([[6.0, 2.0, 3.0, 1.5], [1.0, 2.0, 3.0, 4.0]]))
    assert Sampler()(logits, md).sampled.tolist() == [0, 3]


def test_the_sampler_leaves_the_callers_logits_alone():
    logits = distinct_logits(3, 16, seed=5)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.0, logit_bias={2: 10.0}),
        SamplingParams(min_tokens=3, stop_token_ids=[4], repetition_penalty=1.5),
        SamplingParams(temperature=0.9, top_k=3, top_p=0.5, min_p=0.1, presence_penalty=1.0),
    ]
    Sampler()(logits, metadata(params, outputs=[[3], [3], [3]], prompts=[[5], [5], [5]]))
    assert torch.equal(logits, before)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    vocab = 8
    logits = torch.full((1, vocab), -5.0)
    logits[0, EOS] = 10.0
    logits[0, 5] = 9.0
    logits[0, 6] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    for outputs, expected in [([], 6), ([6], 6), ([6, 6], EOS)]:
        md = metadata([params], outputs=[outputs])
        assert md.banned_token_ids == ({} if len(outputs) >= 2 else {0: [EOS, 5]})
        assert Sampler()(logits.clone(), md).sampled.item() == expected
    # With ignore_eos only the stop ids are banned; extra stop ids from the model count too.
    params = SamplingParams(min_tokens=1, ignore_eos=True, extra_stop_token_ids=[7])
    assert metadata([params]).banned_token_ids == {0: [7]}


# ---- greedy, temperature ----------------------------------------------------------------------


def test_greedy_rows_are_the_argmax_in_a_mixed_batch():
    logits = distinct_logits(6, 40, seed=3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, top_k=5, seed=1),
        SamplingParams(temperature=1e-6, top_p=0.1),
        SamplingParams(temperature=2.0, min_p=0.01),
        SamplingParams(temperature=0.0, top_k=3, seed=9),
        SamplingParams(temperature=1.0),
    ]
    md = metadata(params)
    assert not md.all_greedy and not md.all_random
    for _ in range(10):
        sampled = Sampler()(logits, md).sampled
        assert sampled[[0, 2, 4]].tolist() == logits[[0, 2, 4]].argmax(dim=-1).tolist()
    all_greedy = metadata([SamplingParams(temperature=0.0)] * 6)
    assert all_greedy.all_greedy and all_greedy.top_k is None
    assert torch.equal(Sampler()(logits, all_greedy).sampled, logits.argmax(dim=-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_draws_follow_softmax_of_logits_over_t(temperature):
    logits = torch.tensor([1.0, 0.4, 0.0, -0.8])
    draws = 20000
    torch.manual_seed(0)
    params = [SamplingParams(temperature=temperature)] * draws
    sampled = Sampler()(logits.expand(draws, 4).clone(), metadata(params)).sampled
    counts = np.bincount(sampled.numpy(), minlength=4)
    expected = torch.softmax(logits.double() / temperature, dim=0).numpy() * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (counts, expected)  # 3 degrees of freedom, p = 0.001
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))


def test_seeded_draws_follow_the_distribution_too():
    logits = torch.tensor([0.5, 0.0, -0.5])
    draws = 6000
    params = [SamplingParams(temperature=0.8, seed=s) for s in range(draws)]
    sampled = Sampler()(logits.expand(draws, 3).clone(), metadata(params)).sampled
    counts = np.bincount(sampled.numpy(), minlength=3)
    expected = torch.softmax(logits.double() / 0.8, dim=0).numpy() * draws
    assert float(((counts - expected) ** 2 / expected).sum()) < 13.82  # 2 dof, p = 0.001


# ---- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_the_raw_top_n_with_the_sampled_tokens_logprob_and_rank():
    vocab = 20
    logits = distinct_logits(3, vocab, seed=8)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        # Penalties and temperature shape the draw, not the reported logprobs.
        SamplingParams(temperature=0.5, top_k=4, repetition_penalty=1.8, logprobs=2, seed=4),
        SamplingParams(temperature=0.0, logit_bias={int(logits[2].argmin()): 100.0}),
    ]
    md = metadata(params, outputs=[[], [int(logits[1].argmax())], []], prompts=[[0], [0], [0]])
    assert md.max_num_logprobs == 3
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits.double(), dim=-1)
    sampled = out.sampled.tolist()
    assert out.logprob_token_ids.shape == out.logprobs.shape == (3, 4)
    for row in range(3):
        token = sampled[row]
        order = torch.argsort(raw[row], descending=True).tolist()
        assert out.logprob_token_ids[row].tolist() == [token, *order[:3]]
        expected = [raw[row, token].item(), *raw[row, order[:3]].tolist()]
        assert out.logprobs[row].tolist() == pytest.approx(expected, abs=1e-5)
        assert out.sampled_ranks[row].item() == order.index(token) + 1
    assert out.sampled_ranks[0].item() == 1
    assert out.sampled_ranks[2].item() == vocab  # the biased token is the raw least likely


def test_gather_logprobs_without_top_tokens():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0]]), dim=-1)
    ids, values, ranks = gather_logprobs(logprobs, torch.tensor([2]), 0)
    assert ids.tolist() == [[2]] and ranks.tolist() == [2]
    assert values[0, 0].item() == pytest.approx(logprobs[0, 2].item())


def test_no_logprobs_unless_asked():
    out = Sampler()(distinct_logits(2, 8, seed=1), metadata([SamplingParams()] * 2))
    assert out.logprobs is None and out.logprob_token_ids is None and out.sampled_ranks is None
