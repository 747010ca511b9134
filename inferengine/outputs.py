"""What users get back: vLLM-shaped `RequestOutput`, `CompletionOutput` and `Logprob`."""

from __future__ import annotations

import array
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> its Logprob (the chosen token plus the top N).
PositionLogprobs = dict[int, Logprob]


def top_two_margin(position: PositionLogprobs) -> float | None:
    """Logprob of the rank-1 token minus that of the rank-2 token (how near a tie the choice
    was); None unless both are present (ask for logprobs >= 2)."""
    ranked = {lp.rank: lp.logprob for lp in position.values()}
    if 1 not in ranked or 2 not in ranked:
        return None
    return ranked[1] - ranked[2]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    queued_time: float | None = None  # entered the engine core's scheduler
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine refused or failed the request
    kv_transfer_params: dict | None = None  # a disaggregated producer's, for the consumer
    pooled: bytes | None = None  # a pooling request's vector, float32 bytes (`embedding`)
    extra: dict = field(default_factory=dict)

    @property
    def embedding(self) -> list[float] | None:
        """A pooling request's vector (None for a generation request)."""
        if self.pooled is None:
            return None
        return array.array("f", self.pooled).tolist()


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s answer per prompt, shaped like vLLM's."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s answer per pair, shaped like vLLM's."""

    request_id: str
    outputs: ScoringOutput
    finished: bool = True
