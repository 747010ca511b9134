"""Sampling with n-gram speculation keeps the target's distribution, end to end: a statistical
test on a tiny model cannot tell speculative decoding from plain decoding, yet flags a sampler
that is wrong in a realistic way.

The model: a tiny random Llama whose LM head is built from its own input embeddings so that each
token is followed by the next token of a fixed 6-token cycle (most likely), the one after it or
itself again. A random tiny model's next-token distribution is nearly flat over its 320 tokens
(its logits vary by ~0.5), so drafts would almost never be accepted and sampled sequences would
almost never repeat; this one puts nearly all the mass on a few cycle tokens with distinct
probabilities (about 0.55-0.8 on the next one at temperature 1), and the prompt, the cycle three
times over, makes the n-gram lookup draft the cycle's continuation on nearly every decode step.
So drafts are accepted often, rejected often, at every draft position, and the residual and bonus
draws all matter for what is emitted.

The test: many unseeded requests of one prompt, with and without speculation; at each output
position, and for whole output sequences, a chi-square test of homogeneity (rare outcomes pooled)
compares the two samples. Torch's global generator, which unseeded rows draw from (noise for
`random_sample`, uniforms for the rejection sampler), is seeded before each run, so the test is
deterministic; the significance level (1e-6 per test, Bonferroni over the tests of a case) makes
a failure on a different random stream (a change in the order of draws) negligibly likely, while
the same test with a rejection sampler that draws the correction token from the target instead
of the residual (a classic bug) gives p-values below 1e-50.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest
import torch

from inferengine import LLM, SamplingParams
from inferengine.spec_decode.draft_policy import DraftLengthPolicy
from tests.conftest import BOS_ID, EOS_ID, VOCAB_SIZE, build_tokenizer

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3}  # fmt: skip
CYCLE = 6
# Each token's successors and their weights in the LM head: the next cycle token, the one after
# it, itself. HEAD_SCALE sets how peaked the distribution is at temperature 1.
SUCCESSORS = ((1, 1.0), (2, 0.85), (0, 0.7))
HEAD_SCALE = 4.0
NUM_REQUESTS = 2000
MAX_TOKENS = 6
ALPHA = 1e-6  # family-wise per case, over its MAX_TOKENS + 1 tests
MIN_POOLED = 10  # outcomes seen fewer times in both samples together go into one bin

CASES = {
    "temperature-1": {"temperature": 1.0},
    "temperature-1.5-top-k-top-p": {"temperature": 1.5, "top_k": 4, "top_p": 0.9},
}


def build_cycle_checkpoint(out_dir: Path) -> list[list[int]]:
    """A tiny Llama (untied head) whose head row of token y sums the input embeddings of the
    tokens that lead to y; the transformer layers are scaled down so that the last position's
    hidden state stays close to its token's embedding. Returns the cycles."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,  # wide enough that random embeddings are nearly orthogonal
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        order = torch.randperm(VOCAB_SIZE - 2) + 2  # BOS and EOS stay out of the cycles
    cycles = order[: (VOCAB_SIZE - 2) // CYCLE * CYCLE].view(-1, CYCLE)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "embed_tokens" not in name and "lm_head" not in name:
                p.mul_(0.3)
        emb = model.model.embed_tokens.weight
        head = torch.zeros_like(model.lm_head.weight)
        for shift, weight in SUCCESSORS:
            head[cycles.roll(-shift, dims=1).reshape(-1)] += weight * emb[cycles.reshape(-1)]
        model.lm_head.weight.copy_(HEAD_SCALE * head)
    model.eval()
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return cycles.tolist()


@pytest.fixture(scope="module")
def cycle_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("cycle-llama")
    cycles = build_cycle_checkpoint(out)
    return str(out), cycles[0] * 3


@pytest.fixture(scope="module")
def engines(cycle_model):
    """Engines without and with speculation, built once for the module."""
    path, _ = cycle_model
    plain = LLM(path, max_model_len=64, max_num_seqs=512)
    spec = LLM(path, max_model_len=64, max_num_seqs=512, speculative_config=SPEC)
    return plain, spec


@pytest.fixture(autouse=True)
def always_speculate(monkeypatch):
    """Draft on every step, as many tokens as the proposer finds: the dynamic draft-length
    policy decides from measured step times, which would make the draws (and this test) vary
    from run to run."""
    monkeypatch.setattr(DraftLengthPolicy, "speculate_now", lambda self, num_decoding: True)
    monkeypatch.setattr(
        DraftLengthPolicy,
        "num_drafts",
        lambda self, request_id, available, batch_tokens: available,
    )


def _sample(llm: LLM, prompt: list[int], params: dict, seed: int):
    """NUM_REQUESTS unseeded requests of `prompt`; their output sequences and the spec stats
    they added."""
    stats = llm.llm_engine.core.scheduler.spec_stats
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    before_pos = list(stats.num_accepted_tokens_per_pos)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, **params)
    torch.manual_seed(seed)
    outputs = llm.generate([{"prompt_token_ids": prompt}] * NUM_REQUESTS, sampling, use_tqdm=False)
    sequences = [tuple(o.outputs[0].token_ids) for o in outputs]
    assert all(len(s) == MAX_TOKENS for s in sequences)
    after = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    per_pos = list(stats.num_accepted_tokens_per_pos)
    per_pos = [a - (before_pos[i] if i < len(before_pos) else 0) for i, a in enumerate(per_pos)]
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after, before, strict=True))
    return sequences, (drafts, draft_tokens, accepted, per_pos)


def chi_square_homogeneity(a: list, b: list) -> tuple[float, int, float]:
    """Pearson's chi-square test that two samples of outcomes come from one distribution.

    Outcomes seen fewer than MIN_POOLED times in both samples together share one bin (joined to
    the smallest other bin if it is still that rare), so that no expected count is much below
    MIN_POOLED / 2 for samples of equal size. Returns (statistic, degrees of freedom, p-value);
    the p-value is the chi-square survival function, the regularized upper incomplete gamma
    function Q(df / 2, x / 2) (scipy is not a dependency).
    """
    count_a, count_b = collections.Counter(a), collections.Counter(b)
    columns, rare = [], [0, 0]
    for outcome, n in (count_a + count_b).most_common():
        pair = [count_a[outcome], count_b[outcome]]
        if n >= MIN_POOLED:
            columns.append(pair)
        else:
            rare = [rare[0] + pair[0], rare[1] + pair[1]]
    if sum(rare) >= MIN_POOLED or not columns:
        columns.append(rare)
    else:
        columns[-1] = [columns[-1][0] + rare[0], columns[-1][1] + rare[1]]
    table = torch.tensor(columns, dtype=torch.float64).T
    df = table.shape[1] - 1
    if df == 0:
        return 0.0, 0, 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = float(((table - expected) ** 2 / expected).sum())
    half = torch.tensor([df / 2, stat / 2], dtype=torch.float64)
    return stat, df, float(torch.special.gammaincc(half[0], half[1]))


def compare(plain: list[tuple[int, ...]], other: list[tuple[int, ...]]):
    """One test per output position and one of whole sequences: (name, stat, df, p) each."""
    tests = []
    for pos in range(MAX_TOKENS):
        stat, df, p = chi_square_homogeneity([s[pos] for s in plain], [s[pos] for s in other])
        tests.append((f"position {pos}", stat, df, p))
    stat, df, p = chi_square_homogeneity(plain, other)
    tests.append(("sequence", stat, df, p))
    return tests


def _describe(tests) -> str:
    return "; ".join(f"{n}: chi2={s:.1f} df={d} p={p:.2g}" for n, s, d, p in tests)


@pytest.fixture(scope="module")
def plain_samples(engines, cycle_model):
    """Samples of plain decoding per case, drawn once: the positive and negative checks of a
    case compare against the same ones."""
    cache: dict[str, list[tuple[int, ...]]] = {}

    def get(case: str) -> list[tuple[int, ...]]:
        if case not in cache:
            cache[case] = _sample(engines[0], cycle_model[1], CASES[case], seed=1)[0]
        return cache[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_speculation_keeps_the_sampling_distribution(engines, cycle_model, plain_samples, case):
    _, prompt = cycle_model
    start = time.perf_counter()
    plain = plain_samples(case)
    spec, (drafts, draft_tokens, accepted, per_pos) = _sample(
        engines[1], prompt, CASES[case], seed=2
    )
    # The drafts mattered: proposed on most decode steps, accepted and rejected at every draft
    # position (a request whose drafts run out emits the rest one token per step).
    decode_tokens = NUM_REQUESTS * (MAX_TOKENS - 1)
    plain_steps = decode_tokens - drafts - accepted
    assert drafts > 2 * plain_steps, (drafts, plain_steps)
    assert 0.2 < accepted / draft_tokens < 0.8, (accepted, draft_tokens)
    assert len(per_pos) == SPEC["num_speculative_tokens"] and min(per_pos) > 0.05 * drafts, per_pos
    tests = compare(plain, spec)
    print(
        f"\n{case}: drafts={drafts} draft_tokens={draft_tokens} accepted={accepted} "
        f"per_pos={per_pos} plain_steps={plain_steps}; {_describe(tests)}; "
        f"{time.perf_counter() - start:.1f} s"
    )
    worst = min(p for *_, p in tests)
    assert worst > ALPHA / len(tests), _describe(tests)


def _correction_from_the_target(real):
    """The classic bug: after a rejection, draw the emitted token from the target p instead of
    the residual max(p - q, 0) (which, for a one-hot draft, is p without the rejected token)."""

    def biased(draft_token_ids, num_draft, target_probs, draft_probs, greedy, generators=None):
        out = real(draft_token_ids, num_draft, target_probs, draft_probs, greedy, generators)
        rows = torch.nonzero(out.num_accepted < num_draft).flatten()
        if rows.numel():
            at = out.num_accepted[rows]
            redraw = torch.multinomial(target_probs[rows, at], 1).squeeze(1)
            out.token_ids[rows, at] = torch.where(greedy[rows], out.token_ids[rows, at], redraw)
        return out

    return biased


def _bonus_from_the_last_draft(real):
    """Another wrong sampler: when every draft is accepted, the bonus token is drawn from the
    distribution at the last draft's position instead of the one after it."""

    def biased(draft_token_ids, num_draft, target_probs, draft_probs, greedy, generators=None):
        out = real(draft_token_ids, num_draft, target_probs, draft_probs, greedy, generators)
        rows = torch.nonzero((out.num_accepted == num_draft) & (num_draft > 0)).flatten()
        if rows.numel():
            at = out.num_accepted[rows]
            redraw = torch.multinomial(target_probs[rows, at - 1], 1).squeeze(1)
            out.token_ids[rows, at] = torch.where(greedy[rows], out.token_ids[rows, at], redraw)
        return out

    return biased


@pytest.mark.parametrize("bug", [_correction_from_the_target, _bonus_from_the_last_draft])
def test_the_same_test_flags_a_biased_rejection_sampler(
    engines, cycle_model, plain_samples, monkeypatch, bug
):
    """Power: the comparison above, on a sampler that is wrong only where drafts are verified."""
    import inferengine.worker.model_runner as model_runner

    _, prompt = cycle_model
    case = "temperature-1"
    start = time.perf_counter()
    plain = plain_samples(case)
    monkeypatch.setattr(model_runner, "rejection_sample", bug(model_runner.rejection_sample))
    biased, (drafts, *_) = _sample(engines[1], prompt, CASES[case], seed=3)
    assert drafts > 0
    tests = compare(plain, biased)
    print(f"\n{bug.__name__}: {_describe(tests)}; {time.perf_counter() - start:.1f} s")
    worst = min(p for *_, p in tests)
    assert worst < ALPHA / len(tests) * 1e-20, _describe(tests)
    # The first token comes from the prefill step, which verifies no drafts: unchanged there.
    assert tests[0][3] > ALPHA / len(tests), _describe(tests)
