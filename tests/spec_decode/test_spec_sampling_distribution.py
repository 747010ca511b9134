"""Sampling with n-gram speculation keeps the target's distribution, end to end: a statistical
test on a tiny model cannot tell speculative decoding from plain decoding, yet the same test
flags rejection samplers that are wrong in realistic ways.

The model. A tiny random model's next-token distribution is nearly flat (its logits vary by ~0.5
over 320 tokens): n-gram drafts would almost never be accepted, and samples would spread over
hundreds of tokens. Here the LM head is built from the model's own input embeddings so that each
token is followed by the next token of a fixed 6-token cycle, the one after it, or itself again
(in that order of likelihood); the transformer layers are scaled down so that the last hidden
state stays close to its token's embedding. At temperature 1 nearly all the mass is on a few
cycle tokens with distinct probabilities, and the prompt, one cycle three times over, makes the
n-gram lookup draft the cycle's continuation on most decode steps. So drafts are accepted and
rejected at every draft position, and the accept/reject decisions, residual draws and bonus
draws all shape what is emitted.

The test. 2000 unseeded requests of that prompt, 6 tokens each, with and without speculation; a
chi-square test of homogeneity at each output position and one of whole output sequences (rare
outcomes pooled). Unseeded rows draw from torch's global generator (the exponential noise of
`random_sample` and the rejection sampler's uniforms), seeded before each run, and the draft
length policy is pinned to "always, as many as found", so every run is the same. The
significance level (1e-6 per comparison, Bonferroni over its 7 tests) makes a failure after a
mere change in the order of random draws negligibly likely (over 25 other seeds per case, the
smallest of 350 p-values was 0.003), while the same test rejects, by the same criterion, a
verifier that draws the token after a rejection from the target instead of the residual
(smallest p below 1e-130 over 12 seeds), one that draws the bonus token from the wrong position
(below 1e-260) and one that verifies against the target at 1/1.2 of the request's temperature
(below 1e-20). Plain decoding at temperature 1.1 against 1.0 is told apart too (p ~ 1e-17,
one seed).
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
# (shift along the cycle, weight in the LM head): next token, the one after it, the same token.
SUCCESSORS = ((1, 1.0), (2, 0.85), (0, 0.7))
HEAD_SCALE = 4.0  # how peaked the next-token distribution is at temperature 1
NUM_REQUESTS = 2000
MAX_TOKENS = 6
ALPHA = 1e-6  # family-wise, per comparison of two samples (MAX_TOKENS + 1 tests)
MIN_POOLED = 10  # outcomes seen fewer times in both samples together share one bin

CASES = {
    "temperature-1": {"temperature": 1.0},
    "temperature-1.5-top-k-top-p": {"temperature": 1.5, "top_k": 4, "top_p": 0.9},
}


def build_cycle_checkpoint(out_dir: Path) -> list[list[int]]:
    """A tiny Llama with an untied head whose row for token y sums the input embeddings of the
    tokens that lead to y (weighted as SUCCESSORS says). Returns the cycles."""
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
def cycle_model(tmp_path_factory) -> tuple[str, list[int]]:
    """The checkpoint's path and the prompt: its first cycle, three times over."""
    out = tmp_path_factory.mktemp("cycle-llama")
    cycles = build_cycle_checkpoint(out)
    return str(out), cycles[0] * 3


@pytest.fixture(scope="module")
def engines(cycle_model):
    """Engines without and with speculation, built once for the module; every one of the 512
    requests of a step may draft (the default cap on drafts a step is lower)."""
    path, _ = cycle_model
    with pytest.MonkeyPatch.context() as mp:
        for module in ("inferengine.config", "inferengine.spec_decode.coordinator"):
            mp.setattr(f"{module}.MAX_DRAFTS_PER_STEP", 512 * SPEC["num_speculative_tokens"])
        plain = LLM(path, max_model_len=64, max_num_seqs=512)
        spec = LLM(path, max_model_len=64, max_num_seqs=512, speculative_config=SPEC)
        yield plain, spec


@pytest.fixture(autouse=True)
def always_speculate(monkeypatch):
    """Draft on every step, as many tokens as the proposer finds: the dynamic draft-length
    policy decides from measured step times, which would make the draws vary from run to run
    (and might turn speculation off on a slow CPU)."""
    monkeypatch.setattr(DraftLengthPolicy, "speculate_now", lambda self, num_decoding: True)
    monkeypatch.setattr(
        DraftLengthPolicy,
        "num_drafts",
        lambda self, request_id, available, batch_tokens, padded=False: available,
    )


def _spec_counts(llm: LLM) -> tuple[int, int, int, list[int]]:
    stats = llm.llm_engine.core.scheduler.spec_stats
    return (
        stats.num_drafts,
        stats.num_draft_tokens,
        stats.num_accepted_tokens,
        list(stats.num_accepted_tokens_per_pos),
    )


def _sample(llm: LLM, prompt: list[int], params: dict, seed: int):
    """NUM_REQUESTS unseeded requests of `prompt`: their output sequences, and the drafts,
    draft tokens, accepted tokens and accepted tokens per draft position of this run."""
    before = _spec_counts(llm)
    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, **params)
    with torch.random.fork_rng():  # the tests after these find the generator as it was
        torch.manual_seed(seed)
        prompts = [{"prompt_token_ids": prompt}] * NUM_REQUESTS
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
    sequences = [tuple(o.outputs[0].token_ids) for o in outputs]
    assert all(len(s) == MAX_TOKENS for s in sequences)
    after = _spec_counts(llm)
    per_pos = [n - (before[3][i] if i < len(before[3]) else 0) for i, n in enumerate(after[3])]
    return sequences, (after[0] - before[0], after[1] - before[1], after[2] - before[2], per_pos)


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


def _same_distribution(tests) -> bool:
    return min(p for *_, p in tests) > ALPHA / len(tests)


def _describe(tests) -> str:
    return "; ".join(f"{n}: chi2={s:.1f} df={d} p={p:.2g}" for n, s, d, p in tests)


@pytest.fixture(scope="module")
def plain_samples(engines, cycle_model):
    """Samples of plain decoding per case, drawn once: the positive and negative checks compare
    against the same ones."""
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
    # The drafts mattered: verified on most decode steps (a step emits one token plus the
    # accepted drafts; the rest of the decode tokens came one per step without drafts), and
    # accepted and rejected at every draft position.
    steps_without_drafts = NUM_REQUESTS * (MAX_TOKENS - 1) - drafts - accepted
    assert drafts > 2 * steps_without_drafts, (drafts, steps_without_drafts)
    assert 0.2 < accepted / draft_tokens < 0.8, (accepted, draft_tokens)
    assert len(per_pos) == SPEC["num_speculative_tokens"], per_pos
    assert min(per_pos) > 0.05 * drafts and per_pos[0] < 0.95 * drafts, (per_pos, drafts)
    tests = compare(plain, spec)
    print(
        f"\n{case}: drafts={drafts} draft_tokens={draft_tokens} accepted={accepted} "
        f"per_pos={per_pos} steps_without_drafts={steps_without_drafts}; {_describe(tests)}; "
        f"{time.perf_counter() - start:.1f} s"
    )
    assert _same_distribution(tests), _describe(tests)


# Wrong verifiers for the negative controls: each wraps the real `rejection_sample` and breaks
# one thing, only for sampled rows (greedy rows keep their argmax).


def _correction_from_the_target(real):
    """The classic bug: after a rejection, the token emitted is drawn from the target p instead
    of the residual max(p - q, 0) (for a one-hot draft, p without the rejected token)."""

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
    """When every draft is accepted, the bonus token is drawn from the distribution at the
    last draft's position instead of the one after it (an off-by-one)."""

    def biased(draft_token_ids, num_draft, target_probs, draft_probs, greedy, generators=None):
        out = real(draft_token_ids, num_draft, target_probs, draft_probs, greedy, generators)
        rows = torch.nonzero((out.num_accepted == num_draft) & (num_draft > 0)).flatten()
        if rows.numel():
            at = out.num_accepted[rows]
            redraw = torch.multinomial(target_probs[rows, at - 1], 1).squeeze(1)
            out.token_ids[rows, at] = torch.where(greedy[rows], out.token_ids[rows, at], redraw)
        return out

    return biased


def _verified_at_a_lower_temperature(real):
    """A subtle one: drafts are verified (and the residual and bonus tokens drawn) against the
    target at 1/1.2 of the request's temperature, p ** 1.2 renormalized, as if the verify rows
    got slightly wrong sampling settings."""

    def biased(draft_token_ids, num_draft, target_probs, draft_probs, greedy, generators=None):
        sharper = target_probs**1.2
        sharper = sharper / sharper.sum(dim=-1, keepdim=True).clamp(min=1e-30)
        probs = torch.where(greedy.view(-1, 1, 1), target_probs, sharper)
        return real(draft_token_ids, num_draft, probs, draft_probs, greedy, generators)

    return biased


@pytest.mark.parametrize(
    "bug",
    [_correction_from_the_target, _bonus_from_the_last_draft, _verified_at_a_lower_temperature],
)
def test_the_same_test_flags_a_biased_rejection_sampler(
    engines, cycle_model, plain_samples, monkeypatch, bug
):
    """Power: the comparison above, with a verifier that is wrong only where drafts are
    verified, tells the samples apart."""
    import inferengine.worker.model_runner as model_runner

    _, prompt = cycle_model
    case = "temperature-1"
    start = time.perf_counter()
    plain = plain_samples(case)
    monkeypatch.setattr(model_runner, "rejection_sample", bug(model_runner.rejection_sample))
    biased, (drafts, *_) = _sample(engines[1], prompt, CASES[case], seed=3)
    assert drafts > NUM_REQUESTS
    tests = compare(plain, biased)
    print(f"\n{bug.__name__}: {_describe(tests)}; {time.perf_counter() - start:.1f} s")
    assert not _same_distribution(tests), _describe(tests)
    # The first token comes from the prefill step, which verifies no drafts: no change there.
    assert tests[0][3] > ALPHA / len(tests), _describe(tests)
