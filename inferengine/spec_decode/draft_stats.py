"""What the draft policy measures (`draft_policy.py` decides from it): batch-size buckets,
per-mode goodput sums, the fit of step time on scheduled tokens, per-request acceptance state.

Every sum fades exponentially so recent steps count most; every update is O(1).
"""

from __future__ import annotations

TINY = 1e-30  # below this, a faded weight is zero (no denormal arithmetic in the step loop)
_MIN_FIT_WEIGHT = 4.0  # recent steps needed before a fitted slope counts
_MIN_FIT_SPREAD = 0.35  # token counts must spread (std over mean) for a slope to mean anything


def bucket_of(num_decoding: int) -> int:
    """The power-of-two bucket of a batch size: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ..."""
    return max(num_decoding - 1, 0).bit_length()


def bucket_bounds(bucket: int) -> tuple[int, int]:
    """The smallest and largest batch size of a bucket."""
    return (1, 1) if bucket == 0 else ((1 << (bucket - 1)) + 1, 1 << bucket)


def bucket_label(bucket: int) -> str:
    lo, hi = bucket_bounds(bucket)
    return str(hi) if lo == hi else f"{lo}-{hi}"


class Goodput:
    """Exponentially weighted sums over one mode's measured steps in one bucket."""

    __slots__ = (
        "emitted",
        "emitted_per_request",
        "last_rate",
        "last_step_seconds",
        "last_tokens_per_second",
        "num_decoding",
        "samples",
        "seconds",
        "tokens",
        "weight",
    )

    def __init__(self) -> None:
        self.weight = self.emitted_per_request = self.seconds = 0.0
        self.num_decoding = self.tokens = self.emitted = 0.0
        self.samples = 0  # measured steps, ever
        self.last_rate: float | None = None  # the rate right after the last measured step
        self.last_step_seconds: float | None = None  # and the mean seconds per step
        self.last_tokens_per_second: float | None = None  # and the tokens per second

    def fade(self, factor: float) -> None:
        if self.weight < TINY:
            self.weight = self.emitted_per_request = self.seconds = 0.0
            self.num_decoding = self.tokens = self.emitted = 0.0
            return
        self.weight *= factor
        self.emitted_per_request *= factor
        self.seconds *= factor
        self.num_decoding *= factor
        self.tokens *= factor
        self.emitted *= factor

    def add(self, num_decoding: int, num_tokens: int, num_emitted: int, seconds: float) -> None:
        self.weight += 1.0
        self.emitted_per_request += num_emitted / num_decoding
        self.seconds += seconds
        self.num_decoding += num_decoding
        self.tokens += num_tokens
        self.emitted += num_emitted
        self.samples += 1
        self.last_rate = self.rate
        self.last_step_seconds = self.seconds / self.weight
        self.last_tokens_per_second = self.tokens_per_second

    @property
    def rate(self) -> float | None:
        """Emitted tokens per decoding request per second; None when unmeasured."""
        return self.emitted_per_request / self.seconds if self.weight > 0 else None

    @property
    def tokens_per_second(self) -> float | None:
        """The rate at this mode's mean batch size; once the sums have faded away (a mode not
        run for long), the last one measured; None when never measured."""
        rate = self.rate
        if rate is None:
            return self.last_tokens_per_second
        return rate * self.num_decoding / self.weight

    def emits_drafts(self, margin: float) -> bool:
        """Whether these steps emitted more than one token per request by `margin` (some
        drafts were accepted)."""
        return self.weight > 0 and self.emitted_per_request / self.weight > 1.0 + margin

    @property
    def emitted_per_token(self) -> float:
        return self.emitted / self.tokens if self.tokens > 0 else 1.0


class LinearFit:
    """Step seconds ≈ a + b * scheduled tokens, least squares weighted to recent steps."""

    __slots__ = ("decay", "last", "w", "x", "xx", "xy", "y")

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.x = self.y = self.xx = self.xy = 0.0
        self.last: tuple[float, float] | None = None  # the last determined (a, b)

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w = self.w * d + 1.0
        self.x = self.x * d + x
        self.y = self.y * d + y
        self.xx = self.xx * d + x * x
        self.xy = self.xy * d + x * y
        line = self._solve()
        if line is not None:
            self.last = line

    def _solve(self) -> tuple[float, float] | None:
        if self.w < _MIN_FIT_WEIGHT:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if mx <= 0 or var <= (_MIN_FIT_SPREAD * mx) ** 2:
            return None
        b = (self.xy / self.w - mx * my) / var
        b = min(max(b, 0.0), my / mx)  # a >= 0 and b >= 0
        return my - b * mx, b


class Bucket:
    """What one bucket of batch sizes measured and decided."""

    __slots__ = (
        "best",
        "explore_age",
        "explore_count",
        "exploring",
        "fit",
        "modes",
        "probe_share",
        "seconds_since_explore",
        "since_explore",
        "steps",
        "switches",
    )

    def __init__(self, fit_decay: float) -> None:
        self.modes = (Goodput(), Goodput())  # indexed by speculated: plain, spec
        self.fit = LinearFit(fit_decay)
        self.best: bool | None = None  # None: undecided, exploring both modes
        self.exploring: bool | None = None  # the losing mode while re-measuring it
        self.explore_count = 0  # measured steps of `exploring` so far
        self.explore_age = 0  # steps since the exploration began
        self.since_explore = 0  # steps since the last exploration ended
        self.seconds_since_explore = 0.0  # and their wall seconds
        self.probe_share = 1.0  # while plain wins: the share of time the next probe may take
        self.steps = [0, 0]  # recorded steps per mode (warm-up included)
        self.switches = 0


class RequestRate:
    __slots__ = ("alpha", "backoff", "last_record")

    def __init__(self, alpha: float, backoff: int, step: int) -> None:
        self.alpha = alpha
        self.backoff = backoff
        self.last_record = step
