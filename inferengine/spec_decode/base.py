"""The proposer interfaces of speculative decoding.

Token proposers (n-gram, suffix) look only at token ids and run in the engine core's process:
after each step the speculation room (`coordinator.py`) asks them for drafts for every request
that may speculate (`may_speculate`) and writes them to `request.spec_token_ids`. Model
proposers (a draft model; later EAGLE-3 / MTP heads) run in the worker beside the target, take
the target's hidden states and are driven through the executor (`Executor.propose_drafts`),
with the same caps decided by the speculation room.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from inferengine.sampling_params import SamplingParams


def may_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next tokens may be drafted and verified, having `num_output_tokens`
    (those on their way included): not when its sampling depends on earlier draws or tokens
    (seeded sampling, whose draws must stay those of plain decoding; penalties; a pending
    `min_tokens`) or it reports something per sampled token (logprobs). The engine core drafts
    by this rule; the worker counts on it when it verifies."""
    return (
        (params.seed is None or params.greedy)
        and params.logprobs is None
        and not params.uses_penalties
        and num_output_tokens >= params.min_tokens
    )


class TokenProposer(Protocol):
    def propose(
        self,
        token_ids: Sequence[int],
        max_drafts: int | None = None,
        request_id: str = "",
        lookahead: int = 0,
    ) -> list[int]:
        """Up to `max_drafts` tokens to follow `token_ids` (prompt and output so far) of
        request `request_id`; maybe none. With `lookahead`, that many tokens are on their way
        (sampled, not yet known): the continuation's first `lookahead` tokens stand for them,
        and the drafts are the tokens after those."""
        ...

    def probe(self, token_ids: Sequence[int], request_id: str = "") -> bool:
        """Whether `propose` would draft something after `token_ids` now: asked of a few
        requests while nothing speculates, so it should cost little."""
        ...

    def finish(
        self, request_id: str, token_ids: Sequence[int] | None = None, num_prompt_tokens: int = 0
    ) -> None:
        """Request `request_id` ended with `token_ids` (its first `num_prompt_tokens` are the
        prompt): drop what is kept for it, or keep its text for later requests."""
        ...
