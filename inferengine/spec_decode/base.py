"""The proposer interfaces of speculative decoding.

Token proposers (n-gram, suffix) look only at token ids and run in the engine core: after each
step it asks them for drafts for every request that may speculate and writes them to
`request.spec_token_ids`. Model proposers (a draft model; later EAGLE-3 / MTP heads) run in
the worker beside the target, take the target's hidden states and are driven through the
executor (`Executor.propose_drafts`), with the same caps decided by the engine core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


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
