"""How much to speculate: per step whether the batch speculates at all, per request how many
drafts to keep, both from measurements (step times, goodput, acceptance rates), not thresholds.

Runs in the engine core's step loop at every step with up to hundreds of requests: each call is
O(1) (`num_drafts` O(k)); nothing here may scan all requests, sort, or keep per-token history.

Two levels:

**Whole batch: `speculate_now(num_decoding)`.** Speculating makes the engine core run
synchronously (a draft depends on the previous step's token), which alone costs throughput at
high concurrency; a batch that does not speculate goes back to async scheduling. Each bucket of
batch sizes (powers of two of `num_decoding`: 1, 2, 3-4, 5-8, ..., 129-256) keeps, for each
mode, exponentially weighted sums of what `record_step` measured; its goodput is the emitted
tokens per decoding request per second of wall time between step completions, so that steps at
slightly different batch sizes within a bucket compare fairly. (`describe` multiplies it by the
mode's mean batch size to give tokens per second.) The sums fade by `goodput_decay` at every
step recorded in the bucket, whatever its mode, so a mode measured long ago carries no weight
once it is measured again.

- A bucket starts undecided and explores: `explore_steps` measured steps of the mode the engine
  is in, then as many of the other; then it decides. Speculation wins only when its goodput beats
  plain decoding's by `switch_margin`; later, plain decoding wins back as soon as it is better at
  all (plain is the safe default, and the band between is sticky either way, so no flapping).
- Once the time spent in the winning mode since the last exploration is large enough that
  another exploration would take its share of the bucket's wall time (judged by the losing
  mode's last measured seconds per step), the bucket measures the losing mode again for
  `explore_steps` steps and switches if that mode now wins, so a changed workload can switch
  back. While speculation wins, that share is `explore_budget` and plain is re-measured no
  sooner than `min_reexplore_gap` steps. While plain wins, speculation is probed again with
  exponential back-off: the share starts at `probe_share` when the bucket decides or switches
  and halves with each probe speculation loses, down to `explore_budget`; so a bucket that
  decided on a few failed drafts tries again within a few dozen steps, and one where
  speculation keeps losing soon probes at the budget's rate. A bucket re-explores early (at
  most once per `min_reexplore_gap` steps) when the current mode's goodput has fallen below
  the losing mode's last measurement, e.g. when acceptance collapses.
- The first `warmup_steps` after every change of mode are not measured (the async pipeline
  drains or refills, a CUDA graph may be cold).
- Worst-case cost of exploring, once decided: the back-off's first probes of speculation
  (about log2(probe_share / explore_budget) of them, five by default) cost one exploration
  each; after them the losing mode runs at most `explore_budget` (1%) of the bucket's wall
  time, which costs that fraction times the relative difference in goodput (0.34% of
  throughput when the losing mode runs at 0.66x the winner), whatever a losing step costs; a
  losing mode that is slow per step is re-measured less often in steps (switching back may
  then take about 100 times one exploration, e.g. 6 verify steps of 0.17 s at batch 256 every
  ~100 s). Early re-exploration happens only when the other mode looked better at its
  last measurement, so its expected cost is not positive. Every bucket also pays one initial
  exploration (`explore_steps + warmup_steps` steps in the losing mode).

**Per request: `num_drafts(request_id, available, batch_tokens)`.** Under the usual model each
draft is accepted with probability alpha given that the ones before it were, so the j-th draft
(1-based) adds alpha^j expected tokens. Verifying one more token lengthens the step from
T = a + b*N to T + b (N = `batch_tokens`; a, b from a least-squares fit of step seconds on
scheduled tokens over the recorded speculative steps of the current bucket, weighted to recent
ones by `fit_decay`), while the whole batch emits E tokens per step (E = rho*N, rho = emitted
per scheduled token measured in the bucket's speculative steps). Goodput E/T grows iff
(E + alpha^j) / (T + b) > E/T, i.e.

    keep the j-th draft while  alpha^j > max(min_gain, b * E / (a + b*N)).

`min_gain` stands for the per-draft costs the fit cannot see (proposing, bookkeeping). Before the
fit is determined (few steps, or scheduled tokens that hardly vary) the bucket's last slope is
used, else one fitted over all buckets, else b = 0. Never more than `available` (nor
`num_speculative_tokens`).

When the step's verify runs in a padded shape (`padded=True`: a CUDA graph holding 1 + k tokens
for every sequence, the engine core learns it from the verify steps it collects), the step
costs the same whatever the drafts: a request that keeps any draft keeps all it has. N-gram
drafts are accepted in runs (a quote is copied whole or not at all), so cutting them by the
model above would drop the long runs for nothing.

A request's alpha is its own exponentially weighted acceptance (`acceptance_weight` per
observed draft: each accepted draft is a success, the first rejected one a failure, later ones
unobserved), starting from the global rate: the same counts over all requests, fading by
`global_decay` per step, with `prior_weight` pseudo-drafts at `prior_acceptance` (optimistic, so
a fresh engine or a long pause tries speculating again). A request whose drafts keep being
rejected drops to 0 drafts; it comes back by probing: once `backoff` steps have passed since its
last verified draft it gets 1 draft anyway (all it has when padded); a rejected first draft doubles its backoff (from
`probe_backoff[0]` up to `probe_backoff[1]`), an accepted one resets it. Once its backoff has
grown, a hopeless request costs one draft token per `probe_backoff[1]` steps, and an accepted
probe lifts alpha enough to draft again at once. A request with no verified draft for
`forget_steps` steps (e.g. while the batch ran without speculation) starts again from the
global rate.
"""

from __future__ import annotations

from typing import Any

from inferengine.spec_decode.draft_stats import (
    TINY,
    Bucket,
    LinearFit,
    RequestRate,
    bucket_bounds,
    bucket_label,
    bucket_of,
)

_MIN_TRIGGER_WEIGHT = 2.0  # the current mode's goodput must rest on this much recent weight


__all__ = ["DraftLengthPolicy", "bucket_bounds", "bucket_label", "bucket_of"]


class DraftLengthPolicy:
    """Chooses, from measurements, whether a step speculates and how many drafts each request
    keeps (see the module docstring for the rules). Call per step: `speculate_now` before
    scheduling; `num_drafts` per request when proposing; `record_acceptance` per request after a
    verify; `record_step` once the step completed; `finish` when a request ends."""

    def __init__(
        self,
        num_speculative_tokens: int,
        *,
        explore_steps: int = 5,
        warmup_steps: int = 1,
        explore_budget: float = 0.01,
        min_reexplore_gap: int = 64,
        switch_margin: float = 0.02,
        probe_share: float = 0.25,
        goodput_decay: float = 0.95,
        fit_decay: float = 0.95,
        prior_acceptance: float = 0.7,
        prior_weight: float = 4.0,
        global_decay: float = 0.9,
        acceptance_weight: float = 0.25,
        min_gain: float = 0.05,
        probe_backoff: tuple[int, int] = (4, 64),
        forget_steps: int = 128,
    ):
        for name, value in (
            ("goodput_decay", goodput_decay),
            ("fit_decay", fit_decay),
            ("global_decay", global_decay),
            ("prior_acceptance", prior_acceptance),
            ("min_gain", min_gain),
            ("explore_budget", explore_budget),
            ("probe_share", probe_share),
        ):
            if not 0.0 < value < 1.0:
                raise ValueError(f"{name} must lie strictly between 0 and 1, not {value}.")
        if not 0.0 < acceptance_weight <= 1.0:
            raise ValueError(f"acceptance_weight must be in (0, 1], not {acceptance_weight}.")
        if num_speculative_tokens < 0 or explore_steps < 1 or warmup_steps < 0:
            raise ValueError(
                "num_speculative_tokens and warmup_steps must be >= 0 and explore_steps >= 1."
            )
        if not 1 <= probe_backoff[0] <= probe_backoff[1] < forget_steps:
            raise ValueError(
                "probe_backoff must be (first, most) with 1 <= first <= most < forget_steps."
            )
        if probe_share < explore_budget:
            raise ValueError("probe_share must be at least explore_budget.")
        if min_reexplore_gap < 1 or prior_weight <= 0 or switch_margin < 0:
            raise ValueError(
                "min_reexplore_gap must be >= 1, prior_weight > 0 and switch_margin >= 0."
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.explore_steps = explore_steps
        self.warmup_steps = warmup_steps
        self.explore_budget = explore_budget
        self.min_reexplore_gap = min_reexplore_gap
        self.switch_margin = switch_margin
        self.probe_share = probe_share
        self.goodput_decay = goodput_decay
        self.fit_decay = fit_decay
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.global_decay = global_decay
        self.acceptance_weight = acceptance_weight
        self.min_gain = min_gain
        self.probe_backoff = probe_backoff
        self.forget_steps = forget_steps
        # An exploration gives up after this many steps (the engine could not run the mode).
        self._explore_step_cap = 4 * (explore_steps + warmup_steps)

        self._buckets: list[Bucket | None] = []
        self._bucket: int | None = None  # the bucket of the latest call (sticky, see _bucket_of)
        self._fit = LinearFit(fit_decay)  # over all buckets: the fallback
        self._step = 0  # steps recorded, either mode: the clock of the per-request rules
        self._last_mode: bool | None = None
        self._steps_in_mode = 0
        self._accepted = 0.0  # global acceptance counts, fading per step
        self._trials = 0.0
        self._requests: dict[str, RequestRate] = {}
        self._line: tuple[float, float, float] | None = None  # (a, b, rho) for this step

    # ---- the batch --------------------------------------------------------------------

    def speculate_now(self, num_decoding: int) -> bool:
        """Whether this step, with `num_decoding` requests in decode, should speculate."""
        if self.num_speculative_tokens == 0 or num_decoding <= 0:
            return False
        bucket = self._get_bucket(self._bucket_of(num_decoding))
        self._line = None
        if bucket.best is None:
            current = bool(self._last_mode)
            for mode in (current, not current):
                if bucket.modes[mode].samples < self.explore_steps:
                    return mode
            return current
        return bucket.exploring if bucket.exploring is not None else bucket.best

    def record_step(
        self,
        speculated: bool,
        num_decoding: int,
        num_tokens: int,
        num_emitted: int,
        seconds: float,
    ) -> None:
        """A step completed: whether it speculated, its decoding requests, its scheduled and
        emitted tokens, and the wall seconds since the previous step completed."""
        self._step += 1
        self._line = None
        self._accepted *= self.global_decay
        self._trials *= self.global_decay
        if self._trials < TINY:
            self._accepted = self._trials = 0.0
        mode = bool(speculated)
        if mode != self._last_mode:
            self._last_mode, self._steps_in_mode = mode, 0
        else:
            self._steps_in_mode += 1
        if num_decoding <= 0:
            return
        measured = self._steps_in_mode >= self.warmup_steps and seconds > 0
        bucket = self._get_bucket(self._bucket_of(num_decoding))
        bucket.steps[mode] += 1
        for goodput in bucket.modes:
            goodput.fade(self.goodput_decay)
        if measured:
            bucket.modes[mode].add(num_decoding, num_tokens, num_emitted, seconds)
            if mode:
                bucket.fit.add(num_tokens, seconds)
                self._fit.add(num_tokens, seconds)
        self._advance(bucket, mode, measured, seconds)

    def _advance(self, bucket: Bucket, mode: bool, measured: bool, seconds: float) -> None:
        """The bucket's exploration state after one more recorded step."""
        if bucket.best is None:
            bucket.explore_age += 1
            plain, spec = bucket.modes
            if (
                min(plain.samples, spec.samples) >= self.explore_steps
                or bucket.explore_age >= self._explore_step_cap
            ):
                bucket.best = self._beats(bucket, True)
                bucket.explore_age = bucket.since_explore = 0
                bucket.seconds_since_explore = 0.0
                bucket.probe_share = self.probe_share
        elif bucket.exploring is not None:
            bucket.explore_age += 1
            if measured and mode == bucket.exploring:
                bucket.explore_count += 1
            if (
                bucket.explore_count >= self.explore_steps
                or bucket.explore_age >= self._explore_step_cap
            ):
                if self._beats(bucket, bucket.exploring):
                    bucket.best = bucket.exploring
                    bucket.switches += 1
                    bucket.probe_share = self.probe_share
                else:  # the probe lost: back off
                    bucket.probe_share = max(self.explore_budget, bucket.probe_share / 2)
                bucket.exploring = None
                bucket.since_explore = 0
                bucket.seconds_since_explore = 0.0
        else:
            bucket.since_explore += 1
            bucket.seconds_since_explore += max(seconds, 0.0)
            gap = bucket.since_explore >= self.min_reexplore_gap
            due = bucket.seconds_since_explore >= self._exploration_pause(bucket)
            early = gap and measured and mode == bucket.best and self._other_looked_better(bucket)
            if (due and (gap or not bucket.best)) or early:
                bucket.exploring = not bucket.best
                bucket.explore_count = bucket.explore_age = 0

    def _exploration_pause(self, bucket: Bucket) -> float:
        """Seconds in the winning mode after which measuring the losing one again takes its
        share of the time (`explore_budget`, or the back-off's share while plain wins): one
        exploration lasts `explore_steps + warmup_steps` steps at the losing mode's last
        measured seconds per step."""
        assert bucket.best is not None
        share = self.explore_budget if bucket.best else bucket.probe_share
        per_step = bucket.modes[not bucket.best].last_step_seconds
        if per_step is None:  # the losing mode never ran: judge by the winning one
            per_step = bucket.modes[bucket.best].last_step_seconds or 0.0
        cost = (self.explore_steps + self.warmup_steps) * per_step
        return cost * (1.0 - share) / share

    def _beats(self, bucket: Bucket, candidate: bool) -> bool:
        """Whether `candidate`'s goodput beats the other mode's: speculation must win by
        `switch_margin`, plain decoding by anything."""
        mine, other = bucket.modes[candidate].rate, bucket.modes[not candidate].rate
        if mine is None:
            return False
        if candidate and not bucket.modes[True].emits_drafts(self.min_gain):
            return False  # steps without accepted drafts only pay for running synchronously
        if other is None:
            return True
        return mine > other * (1.0 + self.switch_margin) if candidate else mine > other

    def _other_looked_better(self, bucket: Bucket) -> bool:
        best = bucket.best
        assert best is not None
        current, other = bucket.modes[best], bucket.modes[not best].last_rate
        if other is None or current.weight < _MIN_TRIGGER_WEIGHT:
            return False
        rate = current.rate
        assert rate is not None
        return other > rate * (1.0 + self.switch_margin) if not best else other > rate

    def _bucket_of(self, num_decoding: int) -> int:
        """The bucket of a batch size, sticky: the previous bucket is kept while the size stays
        within an eighth of its bounds, so a batch hovering at a boundary does not flip modes
        every step."""
        previous = self._bucket
        if previous is not None:
            lo, hi = bucket_bounds(previous)
            if lo - lo // 8 <= num_decoding <= hi + hi // 8:
                return previous
        self._bucket = bucket_of(num_decoding)
        return self._bucket

    def _get_bucket(self, index: int) -> Bucket:
        while len(self._buckets) <= index:
            self._buckets.append(None)
        bucket = self._buckets[index]
        if bucket is None:
            bucket = self._buckets[index] = Bucket(self.fit_decay)
        return bucket

    # ---- per request ------------------------------------------------------------------

    def num_drafts(
        self, request_id: str, available: int, batch_tokens: int, padded: bool = False
    ) -> int:
        """How many of the `available` drafts of `request_id` to verify this step, in a batch
        that schedules about `batch_tokens` tokens (call once per request per step); with
        `padded`, every draft up to `num_speculative_tokens` costs the same as one."""
        limit = min(available, self.num_speculative_tokens)
        if limit <= 0:
            return 0
        request = self._request(request_id)
        threshold = self.draft_threshold(batch_tokens)
        alpha, gain, k = request.alpha, request.alpha, 0
        while k < limit and gain > threshold:
            k += 1
            gain *= alpha
        if k == 0 and self._step - request.last_record >= request.backoff:
            k = 1  # a probe, so a request can come back
        return limit if padded and k else k

    def record_acceptance(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """`num_drafts` drafts of `request_id` were verified; the first `num_accepted` passed."""
        if num_drafts <= 0:
            return
        accepted = min(max(num_accepted, 0), num_drafts)
        rejected = accepted < num_drafts
        request = self._request(request_id)
        keep = 1.0 - self.acceptance_weight
        alpha = 1.0 - (1.0 - request.alpha) * keep**accepted
        request.alpha = alpha * keep if rejected else alpha
        request.last_record = self._step
        lo, hi = self.probe_backoff
        request.backoff = lo if accepted > 0 else min(2 * request.backoff, hi)
        self._accepted += accepted
        self._trials += accepted + rejected

    def finish(self, request_id: str) -> None:
        """Forget a request."""
        self._requests.pop(request_id, None)

    def _request(self, request_id: str) -> RequestRate:
        request = self._requests.get(request_id)
        if request is None:
            request = RequestRate(self.acceptance_rate, self.probe_backoff[0], self._step)
            self._requests[request_id] = request
        elif self._step - request.last_record >= self.forget_steps:
            request.alpha = self.acceptance_rate
            request.backoff = self.probe_backoff[0]
            request.last_record = self._step
        return request

    def draft_threshold(self, batch_tokens: int) -> float:
        """The least alpha^j for which the j-th draft is kept in a batch of `batch_tokens`."""
        a, b, rho = self._current_line()
        if b <= 0.0:
            return self.min_gain
        n = max(batch_tokens, 1)
        return max(self.min_gain, b * rho * n / (a + b * n))

    def step_cost(self) -> tuple[float, float]:
        """The fitted (a, b) of step seconds ≈ a + b * tokens at the current batch size."""
        a, b, _ = self._current_line()
        return a, b

    def _current_line(self) -> tuple[float, float, float]:
        if self._line is None:
            line, rho = None, 1.0
            if self._bucket is not None and self._bucket < len(self._buckets):
                bucket = self._buckets[self._bucket]
                if bucket is not None:
                    line = bucket.fit.last
                    rho = bucket.modes[True].emitted_per_token
            line = line or self._fit.last or (0.0, 0.0)
            self._line = (line[0], line[1], rho)
        return self._line

    # ---- reporting --------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        """The global running acceptance rate per draft (with the prior)."""
        w = self.prior_weight
        return (self._accepted + w * self.prior_acceptance) / (self._trials + w)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def bucket_state(self, num_decoding: int) -> str:
        """'spec', 'plain', 'exploring' (undecided) or 'exploring spec' / 'exploring plain'."""
        index = bucket_of(num_decoding)
        bucket = self._buckets[index] if index < len(self._buckets) else None
        if bucket is None or bucket.best is None:
            return "exploring"
        if bucket.exploring is not None:
            return "exploring " + ("spec" if bucket.exploring else "plain")
        return "spec" if bucket.best else "plain"

    def describe(self) -> dict[str, Any]:
        """Per bucket: the decision, both modes' goodput (tokens/s), steps per mode and the
        fitted cost of one more verified token; plus the global acceptance rate."""
        buckets = {}
        for index, bucket in enumerate(self._buckets):
            if bucket is None:
                continue
            _, hi = bucket_bounds(index)
            line = bucket.fit.last
            buckets[bucket_label(index)] = {
                "mode": self.bucket_state(hi),
                "spec_tokens_per_s": bucket.modes[True].tokens_per_second,
                "plain_tokens_per_s": bucket.modes[False].tokens_per_second,
                "spec_steps": bucket.steps[True],
                "plain_steps": bucket.steps[False],
                "switches": bucket.switches,
                "ms_per_token": None if line is None else line[1] * 1e3,
            }
        return {
            "acceptance_rate": self.acceptance_rate,
            "num_requests": self.num_requests,
            "buckets": buckets,
        }

    def summary(self) -> str:
        """One line for the log: each bucket's decision and goodputs, and the acceptance."""

        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:.0f}"

        parts = [
            f"{label}: {b['mode']} (spec {fmt(b['spec_tokens_per_s'])} / "
            f"plain {fmt(b['plain_tokens_per_s'])} tok/s)"
            for label, b in self.describe()["buckets"].items()
        ]
        return f"draft policy: acceptance {self.acceptance_rate:.2f}; batch " + (
            ", ".join(parts) or "no steps yet"
        )
