"""N-gram (prompt lookup) proposer: continue the text the way it went on the last time its tail
appeared earlier in the same request.

The tail of the request's tokens (prompt and output so far), longest first from
`prompt_lookup_max` down to `prompt_lookup_min` tokens, is looked up among the earlier tokens;
at the most recent earlier occurrence, the tokens that followed become the drafts, at most
`num_speculative_tokens` of them. No model runs, so drafts are one-hot for the rejection sampler.
Strong where the output quotes or edits its input (summaries, code edits, agent loops).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from inferengine.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def propose(
        self,
        token_ids: Sequence[int] | np.ndarray,
        max_drafts: int | None = None,
        request_id: str = "",
    ) -> list[int]:
        """Draft tokens to follow `token_ids` (maybe none); at most `max_drafts` if given."""
        c = self.config
        limit = (
            c.num_speculative_tokens
            if max_drafts is None
            else min(max_drafts, c.num_speculative_tokens)
        )
        tokens = np.asarray(token_ids, dtype=np.int64)
        if limit <= 0:
            return []
        for n in range(min(c.prompt_lookup_max, len(tokens) - 1), c.prompt_lookup_min - 1, -1):
            tail = tokens[-n:]
            # Windows that start before the tail itself, so at least one token follows each.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + limit].tolist()
        return []

    def finish(
        self, request_id: str, token_ids: Sequence[int] | None = None, num_prompt_tokens: int = 0
    ) -> None:
        """Nothing is kept between steps."""
