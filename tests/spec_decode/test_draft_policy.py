"""The draft-length policy speculates where measured goodput says it pays, turns itself off where
it does not (and back on when the workload changes), and keeps per request only the drafts worth
their measured cost. Deterministic simulations: a seeded step-time model stands in for the GPU."""

from __future__ import annotations

import random

import pytest

from inferengine.spec_decode.draft_policy import DraftLengthPolicy, bucket_label, bucket_of

K = 4


def step_seconds(speculated: bool, num_decoding: int, num_tokens: int) -> float:
    """A verify step is synchronous (2 ms of host time not hidden) and pays per token; a plain
    step runs async. Speculation pays at small batches and not at large ones."""
    if speculated:
        return 0.012 + 0.00012 * num_tokens + 0.00002 * num_decoding
    return 0.010 + 0.00012 * num_tokens


class Engine:
    """The step loop as the engine core drives the policy, with simulated steps."""

    def __init__(self, policy: DraftLengthPolicy, seed: int = 0):
        self.policy = policy
        self.rng = random.Random(seed)
        self.last_mode: bool | None = None
        self.modes: list[bool] = []
        self.emitted = 0
        self.seconds = 0.0

    def _finish_step(self, spec: bool, n: int, tokens: int, emitted: int) -> None:
        seconds = step_seconds(spec, n, tokens) * (1.0 + 0.03 * self.rng.uniform(-1, 1))
        if self.last_mode is not None and spec != self.last_mode:
            seconds *= 1.5  # the first step after a switch is slow
        self.policy.record_step(spec, n, tokens, emitted, seconds)
        self.last_mode = spec
        self.modes.append(spec)
        self.emitted += emitted
        self.seconds += seconds

    def batch_steps(self, n: int, steps: int, alpha: float = 0.7) -> None:
        """Steps where every request keeps K drafts, accepted at `alpha` on average."""
        expected = sum(alpha**i for i in range(K + 1))
        for _ in range(steps):
            spec = self.policy.speculate_now(n)
            tokens, emitted = (n * (1 + K), round(n * expected)) if spec else (n, n)
            self._finish_step(spec, n, tokens, emitted)

    def request_steps(self, n: int, steps: int, alpha: float) -> None:
        """Steps with `n` requests whose drafts are each accepted with probability `alpha`."""
        for _ in range(steps):
            spec = self.policy.speculate_now(n)
            tokens = emitted = n
            if spec:
                for r in range(n):
                    k = self.policy.num_drafts(f"r{r}", K, tokens)
                    accepted = 0
                    while accepted < k and self.rng.random() < alpha:
                        accepted += 1
                    if k:
                        self.policy.record_acceptance(f"r{r}", k, accepted)
                    tokens += k
                    emitted += accepted
            self._finish_step(spec, n, tokens, emitted)


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 129, 256, 257)] == [
        0, 0, 1, 2, 2, 3, 3, 4, 8, 8, 9
    ]  # fmt: skip
    assert [bucket_label(b) for b in (0, 1, 2, 3, 8)] == ["1", "2", "3-4", "5-8", "129-256"]


def test_no_speculation_without_drafts_or_decoding_requests():
    assert DraftLengthPolicy(0).speculate_now(4) is False
    assert DraftLengthPolicy(0).num_drafts("a", 3, 10) == 0
    assert DraftLengthPolicy(K).speculate_now(0) is False


def test_speculates_at_batch_1_and_turns_itself_off_at_256():
    policy = DraftLengthPolicy(K)
    engine = Engine(policy)
    engine.batch_steps(1, 2000)
    assert policy.bucket_state(1) == "spec"
    assert sum(engine.modes[-1000:]) >= 985  # re-exploring plain costs a few steps only

    engine.modes = []
    engine.emitted, engine.seconds = 0, 0.0
    engine.batch_steps(256, 3000)
    assert policy.bucket_state(256) == "plain"
    assert policy.bucket_state(1) == "spec"  # buckets decide apart
    assert sum(engine.modes) / len(engine.modes) < 0.02  # exploring steps at 256

    plain = Engine(DraftLengthPolicy(0))
    plain.batch_steps(256, 3000)
    goodput = engine.emitted / engine.seconds
    assert goodput >= 0.98 * plain.emitted / plain.seconds

    stats = policy.describe()["buckets"]
    assert stats["1"]["mode"] == "spec" and stats["129-256"]["mode"] == "plain"
    assert stats["1"]["spec_tokens_per_s"] > 1.5 * stats["1"]["plain_tokens_per_s"]
    assert stats["129-256"]["plain_tokens_per_s"] > stats["129-256"]["spec_tokens_per_s"]
    assert "129-256: plain" in policy.summary()


def test_a_collapse_of_acceptance_turns_speculation_off_and_a_recovery_back_on():
    policy = DraftLengthPolicy(K)
    engine = Engine(policy, seed=1)
    engine.request_steps(4, 1000, alpha=0.9)
    assert policy.bucket_state(4) == "spec"
    assert sum(engine.modes[500:1000]) >= 485

    engine.request_steps(4, 1000, alpha=0.0)  # the workload stops matching its drafts
    off = engine.modes.index(False, 1000)
    assert off < 1000 + 150  # spec turned off soon after the collapse
    assert policy.bucket_state(4) == "plain"
    assert sum(engine.modes[1200:2000]) <= 0.03 * 800  # only the periodic re-explorations

    engine.request_steps(4, 1500, alpha=0.9)  # and it comes back
    # within one pause between explorations: an exploration's steps (at most 0.016 s each
    # here) take explore_budget of the time, the rest runs plain (at least 0.0101 s a step)
    steps = policy.explore_steps + policy.warmup_steps
    pause = steps * 0.016 * (1 - policy.explore_budget) / policy.explore_budget / 0.0101
    back = next(i for i in range(2000, 3500) if all(engine.modes[i : i + 50]))
    assert back - 2000 <= pause + 2 * steps
    assert policy.bucket_state(4) == "spec"


def _drive(policy: DraftLengthPolicy, steps: int, accept: dict[str, bool]) -> dict[str, list]:
    """Speculative steps of two requests at a constant cost; `accept` says whose drafts pass."""
    kept: dict[str, list] = {r: [] for r in accept}
    for _ in range(steps):
        policy.speculate_now(len(accept))  # the test drives speculative steps regardless
        for r, passes in accept.items():
            k = policy.num_drafts(r, K, 10)
            kept[r].append(k)
            if k:
                policy.record_acceptance(r, k, k if passes else 0)
        policy.record_step(True, len(accept), 10, 4, 0.01)
    return kept


def test_a_rejected_request_drops_to_0_drafts_an_accepted_one_keeps_all_and_both_recover():
    policy = DraftLengthPolicy(K)
    kept = _drive(policy, 400, {"good": True, "bad": False})
    assert kept["good"] == [K] * 400
    assert kept["bad"][0] == K  # starts from the optimistic prior
    assert kept["bad"][-1] == 0
    probes = kept["bad"][50:]
    assert sum(probes) <= len(probes) / 32  # a probe of 1 draft now and then
    assert set(probes) == {0, 1}

    kept = _drive(policy, 100, {"good": True, "bad": True})  # the bad one turns good
    first = kept["bad"].index(K)
    assert first <= policy.probe_backoff[1] + 5
    assert kept["bad"][first:] == [K] * (100 - first)

    assert policy.num_drafts("good", 2, 10) == 2  # never more than available
    assert policy.num_drafts("good", 9, 10) == K  # nor than num_speculative_tokens


def test_a_large_marginal_token_cost_keeps_fewer_drafts():
    free, costly = DraftLengthPolicy(K), DraftLengthPolicy(K)
    assert costly.step_cost() == (0.0, 0.0)  # unmeasured: the marginal cost counts as 0
    for i in range(40):
        tokens = 64 + 32 * (i % 9)  # 64..320 tokens at batch 64
        costly.speculate_now(64)
        costly.record_step(True, 64, tokens, round(0.6 * tokens), 0.002 + 0.0001 * tokens)
    costly.speculate_now(64)
    a, b = costly.step_cost()
    assert a == pytest.approx(0.002) and b == pytest.approx(0.0001)
    # threshold b * E / (a + b*N) = 0.0001 * 0.6 * 256 / 0.0276 ~ 0.56: only alpha = 0.7 passes
    assert costly.draft_threshold(256) == pytest.approx(0.0001 * 0.6 * 256 / 0.0276, rel=1e-3)
    assert costly.num_drafts("r", K, 256) == 1
    assert free.num_drafts("r", K, 256) == K
    # a small batch in the same bucket pays a smaller share of the step per token
    assert costly.num_drafts("s", K, 16) > 1


def test_a_padded_verify_keeps_every_draft_of_a_request_that_keeps_any():
    policy = DraftLengthPolicy(12, min_gain=0.2)
    _drive(policy, 3, {"half": True})
    policy._request("half").alpha = 0.5  # 0.5 ** 3 < 0.2: the cost model keeps 2 drafts
    assert policy.num_drafts("half", 12, 13) == 2
    assert policy.num_drafts("half", 12, 13, padded=True) == 12
    assert policy.num_drafts("half", 7, 13, padded=True) == 7  # never more than available
    _drive(policy, 40, {"bad": False})  # drops to 0 drafts: a padded step changes nothing
    assert policy.num_drafts("bad", 12, 13, padded=True) == 0


def test_finish_forgets_the_request():
    policy = DraftLengthPolicy(K)
    _drive(policy, 40, {"good": True, "bad": False})
    assert policy.num_requests == 2
    assert policy.num_drafts("bad", K, 10) == 0
    policy.finish("bad")
    policy.finish("never-seen")
    assert policy.num_requests == 1
    assert policy.num_drafts("bad", K, 10) == K  # a new request starts from the global rate


def test_a_batch_at_a_bucket_boundary_does_not_flip_modes_every_step():
    policy = DraftLengthPolicy(K)
    engine = Engine(policy)
    for i in range(400):
        engine.batch_steps(64 + i % 2, 1)  # 64 and 65 lie in different buckets
    switches = sum(a != b for a, b in zip(engine.modes, engine.modes[1:], strict=False))
    assert switches <= 6
    assert len(policy.describe()["buckets"]) == 1


def test_rejects_bad_tunables():
    with pytest.raises(ValueError):
        DraftLengthPolicy(K, goodput_decay=1.0)
    with pytest.raises(ValueError):
        DraftLengthPolicy(K, probe_backoff=(8, 4))
    with pytest.raises(ValueError):
        DraftLengthPolicy(-1)
    with pytest.raises(ValueError):
        DraftLengthPolicy(K, probe_share=0.005)  # below explore_budget


def test_speculating_steps_that_emit_no_draft_never_win_on_noise():
    """No request got an accepted draft (one token per request per step), yet the speculating
    steps happened to measure faster: running synchronously cannot have paid, so plain wins."""
    policy = DraftLengthPolicy(4)
    for _ in range(40):
        mode = policy.speculate_now(64)
        # 64 requests, one token each; the speculating steps look 20% faster (noise).
        policy.record_step(mode, 64, 64, 64, 0.008 if mode else 0.010)
    assert policy.bucket_state(64) == "plain"
    assert not policy.speculate_now(64)


def _one_request(policy: DraftLengthPolicy, steps: int, pays: bool, modes: list[bool]) -> None:
    """Steps of one request at fixed costs (plain 10 ms, speculating 12.5 ms); its drafts are
    all accepted if `pays`, else all rejected."""
    for _ in range(steps):
        spec = policy.speculate_now(1)
        k = policy.num_drafts("r", K, 1) if spec else 0
        accepted = k if pays else 0
        if k:
            policy.record_acceptance("r", k, accepted)
        policy.record_step(spec, 1, 1 + k, 1 + accepted, 0.0125 if spec else 0.010)
        modes.append(spec)


def _runs(modes: list[bool], start: int = 1) -> tuple[list[int], list[int]]:
    """Steps where speculation started, and where plain decoding started, from `start`."""
    began = [i for i in range(start, len(modes)) if modes[i] and not modes[i - 1]]
    ended = [i for i in range(start, len(modes)) if not modes[i] and modes[i - 1]]
    return began, ended


def test_speculation_that_lost_is_probed_again_with_exponential_back_off():
    """Plain wins on failed drafts; speculation is probed again after a pause in which the
    probe (6 steps of 12.5 ms = 75 ms) takes 1/4 of the time, then 1/8, 1/16, ... down to
    explore_budget (1/100): 0.075 s * 3 / 10 ms = 22.5 -> 23 plain steps, then 53, 113, 233,
    473, and 743 from then on. Once drafts pay, the next probe wins and speculation stays on,
    plain re-measured only within explore_budget (6 plain steps per 0.06 s * 99 / 12.5 ms =
    475.2 -> 476 speculating steps)."""
    policy = DraftLengthPolicy(K)
    modes: list[bool] = []
    _one_request(policy, 3000, False, modes)
    began, ended = _runs(modes)
    assert began[0] == 6 and ended[0] == 12  # the first exploration: plain, then speculation
    assert [b - e for b, e in zip(began[1:], ended, strict=False)] == [
        23,
        53,
        113,
        233,
        473,
        743,
        743,
    ]
    assert all(e - b == 6 for b, e in zip(began, ended, strict=True))  # one warm-up + 5 measured
    assert policy.bucket_state(1) == "plain"

    assert ended[-1] == 2435

    _one_request(policy, 2000, True, modes)  # the drafts pay from now on
    began, ended = _runs(modes, start=3000)
    assert began[0] == 2435 + 743  # the next probe, at the back-off's pace
    assert ended[0] == began[0] + 6 + 476  # it won, and speculation stays on
    assert all(modes[began[0] : ended[0]])
    assert [b - e for b, e in zip(began[1:], ended, strict=False)] == [6, 6, 6]  # plain lost
    assert policy.bucket_state(1) == "spec"
